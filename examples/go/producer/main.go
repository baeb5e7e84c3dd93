// Command producer publishes two epochs of 100 float32 batches on channel
// "demo" (or the first argument), once a reader is attached.
package main

import (
	"encoding/binary"
	"log"
	"math"
	"os"
	"time"

	"github.com/tsock/tsock/producer"
	"github.com/tsock/tsock/ring"
)

func main() {
	name := "demo"
	if len(os.Args) > 1 {
		name = os.Args[1]
	}
	p, err := producer.Create(name, producer.Options{Slots: 16, SlotBytes: 1 << 20})
	if err != nil {
		log.Fatal(err)
	}
	defer p.Close()
	if err := p.WaitReaders(1, 30*time.Second); err != nil {
		log.Fatal(err)
	}
	for epoch := 0; epoch < 2; epoch++ {
		for i := 0; i < 100; i++ {
			buf, err := p.Reserve(64*4, time.Second) // waits for the slowest reader
			if err != nil {
				log.Fatal(err)
			}
			for k := 0; k < 64; k++ { // write the batch in place
				binary.LittleEndian.PutUint32(buf[4*k:], math.Float32bits(float32(i*64+k)))
			}
			t := producer.Tensor{Dtype: ring.DtypeFloat32, Shape: []int64{64}}
			if err := p.Publish([]producer.Tensor{t}, nil); err != nil {
				log.Fatal(err)
			}
		}
		if err := p.EndEpoch(time.Second); err != nil {
			log.Fatal(err)
		}
	}
}
