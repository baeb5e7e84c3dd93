// Package testkit holds the helpers the Go tests share: unique channel
// names that are cleaned up, and producers and readers closed at the end
// of a test.
package testkit

import (
	"fmt"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/tsock/tsock/producer"
	"github.com/tsock/tsock/reader"
	"github.com/tsock/tsock/ring"
)

var seq atomic.Int64

// Channel returns a channel name unique to this process and test run, and
// removes its segment file when the test ends.
func Channel(t testing.TB) string {
	t.Helper()
	name := fmt.Sprintf("test-%d-%d-%d", os.Getpid(), seq.Add(1), time.Now().UnixNano()%1e6)
	require.True(t, ring.NameOK(name), name)
	t.Cleanup(func() { os.Remove(ring.ChannelPath(name)) })
	return name
}

// Create makes a producer that is closed when the test ends.
func Create(t testing.TB, name string, o producer.Options) *producer.Producer {
	t.Helper()
	p, err := producer.Create(name, o)
	require.NoError(t, err)
	t.Cleanup(func() { p.Close() })
	return p
}

// Attach attaches a reader that is detached when the test ends.
func Attach(t testing.TB, name string, o reader.Options) *reader.Reader {
	t.Helper()
	r, err := reader.Attach(name, o)
	require.NoError(t, err)
	t.Cleanup(func() { r.Detach() })
	return r
}
