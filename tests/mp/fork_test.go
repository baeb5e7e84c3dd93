package mp

import (
	"fmt"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tsock/tsock/producer"
	"github.com/tsock/tsock/reader"
)

// TestForkedChildDoesNotKeepProducerAlive: a producer that forks (a
// DataLoader worker: fork without exec) and is then SIGKILLed. The child
// inherits the producer's mapping and lives on for 120 s; it must not keep
// the producer's liveness lock: readers get "producer gone" within 10 s of
// its death (as the test saw it reaped) and a new producer can take the
// name at once. Before the fix the mapping, made from the locked
// descriptor, held the locked open file description: readers saw EAGAIN
// and Create ErrExist until the child exited.
//
// Death is detected by a 50 ms liveness poll; the 10 s bound leaves a
// loaded machine room for this goroutine's own scheduling and still tells
// "noticed" from "only once the child is gone", which the child's 120 s
// (it is killed when the test ends) keeps far away.
func TestForkedChildDoesNotKeepProducerAlive(t *testing.T) {
	exe := needABIProducer(t)
	name := channel(t)
	prod := start(t, "forking producer", nil, exe, "fork", name, "120")
	line := prod.waitLine(t, "ready ", 30*time.Second)
	childPid, err := strconv.Atoi(strings.TrimPrefix(line, "ready "))
	require.NoError(t, err, line)
	t.Cleanup(func() {
		_ = syscall.Kill(childPid, syscall.SIGKILL)
		var ws syscall.WaitStatus
		_, _ = syscall.Wait4(childPid, &ws, syscall.WNOHANG, nil) // reaped by init once its parent is gone
	})

	r, err := reader.Attach(name, reader.Options{Start: reader.StartNow})
	require.NoError(t, err)
	defer r.Detach()

	died := killAndReap(t, prod)
	var gone time.Duration
	for {
		b, err := r.Acquire(20 * time.Millisecond)
		if b != nil {
			require.NoError(t, r.Release(b))
			continue
		}
		if err != nil {
			require.ErrorIs(t, err, reader.ErrProducerGone)
			gone = time.Since(died)
			break
		}
		require.Less(t, time.Since(died), 20*time.Second, "reader still sees no producer death (EAGAIN)")
	}
	assert.Less(t, gone, 10*time.Second, "reader noticed the producer's death too late")
	require.NoError(t, syscall.Kill(childPid, 0), "the forked child must still be alive for this test to mean anything")

	np, err := producer.Create(name, producer.Options{Slots: 4, SlotBytes: 4096})
	require.NoError(t, err, "a new producer takes the name while the dead one's child lives")
	require.NoError(t, np.Close())
	t.Logf("producer death -> reader saw producer gone after %v, with the forked child alive", gone.Round(time.Millisecond))
}

// TestForkAnyInstantKeepsNoLock: the host process forks at any instant,
// also while another thread is creating or closing a producer and
// attaching and detaching a reader. No child may ever hold a locked open
// file description, a socket (the join socket, a reader's connection at
// either end: a dead reader's connection held open by a child would keep
// it attached) or a record's memfd: each is registered with its fork guard
// from the moment it exists (before the fix: the lock only after Create
// returned, so a child forked during creation kept the new producer's lock
// for its lifetime).
//
// The storm lasts 4 s, and longer on a loaded machine until there were
// minForks forks and minCreates creates (up to 60 s).
func TestForkAnyInstantKeepsNoLock(t *testing.T) {
	const minForks, minCreates = 200, 50
	exe := needABIProducer(t)
	name := channel(t)
	p := start(t, "fork storm", nil, exe, "forkstorm", name, "4", strconv.Itoa(minForks), strconv.Itoa(minCreates))
	require.Equal(t, 0, p.wait(t, 120*time.Second), "output:\n%s", p.Output())
	var forks, leaks, creates int
	_, err := fmt.Sscanf(p.waitLine(t, "forks ", time.Second), "forks %d leaks %d creates %d", &forks, &leaks, &creates)
	require.NoError(t, err, p.Output())
	t.Logf("%d forks during %d creates", forks, creates)
	require.GreaterOrEqual(t, forks, minForks)
	require.GreaterOrEqual(t, creates, minCreates)
	assert.Zero(t, leaks, "children forked while a producer was created held its lock, a socket or a record")
}
