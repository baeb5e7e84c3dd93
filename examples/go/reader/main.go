// Command reader reads channel "demo" (or the first argument) until the
// producer closes it, printing one line per epoch.
package main

import (
	"errors"
	"fmt"
	"log"
	"os"
	"time"

	"github.com/tsock/tsock/reader"
)

func main() {
	name := "demo"
	if len(os.Args) > 1 {
		name = os.Args[1]
	}
	r, err := reader.Attach(name, reader.Options{AttachTimeout: 30 * time.Second})
	if err != nil {
		log.Fatal(err)
	}
	defer r.Detach()
	for {
		b, err := r.Acquire(-1) // wait; a dead producer still ends the wait
		if errors.Is(err, reader.ErrClosed) {
			return
		}
		if err != nil {
			log.Fatal(err) // reader.ErrProducerGone, ...
		}
		if b.EpochEnd() {
			fmt.Printf("epoch %d: %d batches\n", b.Epoch, b.Index)
		}
		// b.Tensors[i].Data is read-only shared memory, valid until Release.
		if err := r.Release(b); err != nil {
			log.Fatal(err)
		}
	}
}
