package reader_test

import (
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tsock/tsock/reader"
)

// Regression: the Go wrapper read tsock_last_error() in a second cgo call
// after the failing one. The C message is per thread, and a goroutine may
// move to another thread between two cgo calls, so an error could carry
// another goroutine's message, or none ("reader evicted" without the
// reason; found by FuzzAttachAcquire). Each goroutine here fails with its
// own channel name in the message while others keep the threads busy.
func TestErrorDetailStaysWithItsCall(t *testing.T) {
	var stop atomic.Bool
	var spin sync.WaitGroup
	for k := 0; k < 2; k++ {
		spin.Add(1)
		go func() {
			defer spin.Done()
			for !stop.Load() {
			}
		}()
	}
	var wg sync.WaitGroup
	var wrong atomic.Int64
	var first atomic.Value
	for g := 0; g < 12; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			name := fmt.Sprintf("nochan-%d-g%d", os.Getpid(), g)
			for i := 0; i < 25; i++ {
				_, err := reader.Attach(name, reader.Options{AttachTimeout: time.Millisecond})
				if err == nil || !strings.Contains(err.Error(), "'"+name+"'") {
					wrong.Add(1)
					first.CompareAndSwap(nil, fmt.Sprintf("%s: %v", name, err))
				}
			}
		}()
	}
	wg.Wait()
	stop.Store(true)
	spin.Wait()
	if n := wrong.Load(); n > 0 {
		t.Fatalf("%d errors carried another call's message or none; first: %v", n, first.Load())
	}
}
