package mp

// Descriptors whose close blocks (review 2, F1): anyone in the network
// namespace can reach a producer's join socket (its address is listed in
// /proc/net/unix) and send it descriptors. A TCP socket with SO_LINGER and
// unsent data that its peer never reads blocks the close() that drops its
// last reference, for as long as the sender set. The producer must never
// wait for one: its Close, fork() in its process (libtsock.so) and later
// joins go on while the descriptors it was sent are still being closed.

import (
	"bufio"
	"fmt"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tsock/tsock/internal/testkit"
	"github.com/tsock/tsock/producer"
	"github.com/tsock/tsock/reader"
	"github.com/tsock/tsock/ring"
)

// lingerSeconds is how long a lingering socket's last close blocks: far
// longer than any bound of these tests.
const lingerSeconds = 600

// lingerAttempts is how many times each attack is made: the producer's
// close is the one that blocks only when the attacker dropped its own
// reference first, a race the attacker usually, not always, wins.
const lingerAttempts = 4

// joinAddress is the abstract address of channel name's join socket, as
// /proc/net/unix lists it ("@tsock-join-...").
func joinAddress(t *testing.T, name string) string {
	seg, err := ring.OpenSegment(name)
	require.NoError(t, err)
	defer seg.Close()
	return "@" + ring.JoinAddress(seg.JoinKey())[1:]
}

// lingerAttack is the attacker (a helper process): ADDR CHANNEL MEMBER
// HEAVY LIGHT. It finds ADDR in /proc/net/unix, sends lingering sockets to it
// every way it can, and, as a member of the channel's group (MEMBER = 1),
// joins CHANNEL and sends one on its own connection. With the discard
// workers that close them likely stuck by then, it floods (see flood). It prints "attacks done", then keeps its TCP listener (the
// lingering sockets' peer) until killed.
func lingerAttack(addr, name string, member bool, heavy, light int) {
	if !listed(addr) {
		fmt.Println("linger: address not in /proc/net/unix")
		return
	}
	fmt.Println("linger: address listed")
	peer := newStuckPeer()
	sun := &unix.SockaddrUnix{Name: addr}
	dial := func() int {
		c, err := unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
		if err == nil {
			err = unix.Connect(c, sun)
		}
		if err != nil {
			fmt.Println("linger: connect:", err)
			os.Exit(1)
		}
		return c
	}
	good := ring.NewJoinRequest(0).Bytes()
	// Knowing the address is not being let in: the request's descriptor
	// decides (here, of another file).
	null, err := unix.Open("/dev/null", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	must(err)
	c := dial()
	must(testkit.SendRequest(c, good, null))
	if rep, fd, err := testkit.ReadReply(c); err != nil || fd >= 0 {
		fmt.Println("linger: DONE joined, or no answer:", err)
	} else {
		fmt.Println("linger: refused with status", rep.Status)
	}
	unix.Close(c)
	unix.Close(null)
	var conns []int
	for range lingerAttempts {
		// The lingering socket as the join's proof.
		conns = append(conns, peer.send(dial, nil, good, 0))
		// Queued behind a request the producer refuses (and then
		// closes the connection, with this message unread).
		conns = append(conns, peer.send(dial, []byte{0}, []byte{1}, 0))
		// Among more descriptors than the producer used to make room for.
		conns = append(conns, peer.send(dial, nil, good, 19))
	}
	// Beyond this user's share of connections not yet joined: the
	// producer closes the connection at once, the message in it unread.
	var silent []int
	for range readersPendingPerUID {
		silent = append(silent, dial())
	}
	for range lingerAttempts {
		conns = append(conns, peer.send(dial, nil, good, 0))
	}
	for _, c := range silent {
		unix.Close(c)
	}
	if member {
		join := func() int {
			// Its silent connections are dropped a moment after it
			// closed them: until then it has no share left.
			r, err := testkit.JoinRogue(name, 0)
			for end := time.Now().Add(20 * time.Second); err != nil && time.Now().Before(end); {
				time.Sleep(20 * time.Millisecond)
				r, err = testkit.JoinRogue(name, 0)
			}
			if err != nil {
				fmt.Println("linger: join:", err)
				os.Exit(1)
			}
			return r.Conn
		}
		for range lingerAttempts {
			// Then it dies (here: leaves its connection to the exit).
			conns = append(conns, peer.send(join, nil, []byte{0}, 0))
		}
	}
	if heavy+light > 0 {
		conns = append(conns, flood(addr, heavy, light)...)
	}
	fmt.Println("linger: attacks done")
	time.Sleep(time.Hour)
	for _, c := range conns {
		unix.Close(c)
	}
}

// floodMessages is how many messages of maxRights descriptors each flood
// connection queues (a request, refused, then the rest behind it).
const (
	floodMessages = 8
	maxRights     = 253
)

// flood opens up to heavy+light connections to addr, each queueing
// floodMessages messages of 253 descriptors of /dev/null (light ones: of
// one). Before review 4's fix the producer held every descriptor it
// received while its discard workers were stuck. A connection the
// producer does not accept within 2 s (its backlog full) ends the flood.
// It prints how many descriptors went out.
func flood(addr string, heavy, light int) []int {
	null, err := unix.Open("/dev/null", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	must(err)
	many := make([]int, maxRights)
	for i := range many {
		many[i] = null
	}
	sent, opened := 0, []int{}
	// Heavy connections spend the budget; light ones, one descriptor
	// each, are what the producer gives up whole past it.
	for i := range heavy + light {
		count := maxRights
		if i >= heavy {
			count = 1
		}
		c, err := unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, 0)
		must(err)
		// A full backlog (EAGAIN) is retried for 2 s: the producer may
		// only be behind.
		for end := time.Now().Add(2 * time.Second); ; time.Sleep(5 * time.Millisecond) {
			err = unix.Connect(c, &unix.SockaddrUnix{Name: addr})
			if err != unix.EAGAIN || time.Now().After(end) {
				break
			}
		}
		if err != nil {
			fmt.Println("linger: flood: connect:", err)
			unix.Close(c)
			break
		}
		opened = append(opened, c)
		for range floodMessages {
			err := unix.Sendmsg(c, ring.NewJoinRequest(0).Bytes(), unix.UnixRights(many[:count]...), nil,
				unix.MSG_NOSIGNAL|unix.MSG_DONTWAIT)
			if err == nil {
				sent += count
			}
		}
	}
	unix.Close(null)
	fmt.Printf("linger: flood sent %d descriptors on %d connections\n", sent, len(opened))
	return opened
}

// readersPendingPerUID mirrors readers.PendingPerUID (internal to the
// producer; the test only needs to exceed it).
const readersPendingPerUID = 16

// listed reports whether /proc/net/unix lists addr: anyone in the network
// namespace can read it.
func listed(addr string) bool {
	f, err := os.Open("/proc/net/unix")
	if err != nil {
		return false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if strings.HasSuffix(sc.Text(), " "+addr) {
			return true
		}
	}
	return false
}

// stuckPeer is a TCP listener that never accepts: a socket connected to it
// with its send queue full has data that never leaves.
type stuckPeer struct{ addr unix.SockaddrInet4 }

func newStuckPeer() *stuckPeer {
	l, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	must(err)
	// A small receive buffer (the accepted sockets inherit it) fills fast.
	must(unix.SetsockoptInt(l, unix.SOL_SOCKET, unix.SO_RCVBUF, 4096))
	must(unix.Bind(l, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}))
	must(unix.Listen(l, 128))
	sa, err := unix.Getsockname(l)
	must(err)
	return &stuckPeer{addr: *sa.(*unix.SockaddrInet4)}
}

func must(err error) {
	if err != nil {
		fmt.Println("linger:", err)
		os.Exit(1)
	}
}

// lingering makes a TCP socket whose last close blocks lingerSeconds.
func (p *stuckPeer) lingering() int {
	c, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	must(err)
	must(unix.SetsockoptInt(c, unix.SOL_SOCKET, unix.SO_SNDBUF, 4096))
	must(unix.Connect(c, &p.addr))
	must(unix.SetNonblock(c, true))
	chunk := make([]byte, 1<<16)
	// Until nothing more goes for 100 ms: the receiver's buffer is full
	// (short EAGAINs only mean the small send buffer waits for it).
	for full := 0; full < 50; {
		if _, err := unix.Write(c, chunk); err != nil {
			full++
			time.Sleep(2 * time.Millisecond)
		} else {
			full = 0
		}
	}
	must(unix.SetNonblock(c, false))
	must(unix.SetsockoptLinger(c, unix.SOL_SOCKET, unix.SO_LINGER, &unix.Linger{Onoff: 1, Linger: lingerSeconds}))
	return c
}

// send makes a lingering socket and extra more descriptors (of /dev/null),
// dials a connection, sends before (if any), then msg with the
// descriptors, and drops its own reference to the socket at once, so that
// the producer's is the last. When the producer was faster, that drop is
// the one that blocks: here, on a thread of its own. It returns the
// connection.
func (p *stuckPeer) send(dial func() int, before, msg []byte, extra int) int {
	fds := []int{p.lingering()}
	for range extra {
		n, err := unix.Open("/dev/null", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		must(err)
		fds = append(fds, n)
	}
	conn := dial()
	if before != nil {
		_ = unix.Sendmsg(conn, before, nil, nil, unix.MSG_NOSIGNAL)
	}
	done := make(chan struct{})
	go func() {
		_ = unix.Sendmsg(conn, msg, unix.UnixRights(fds...), nil, unix.MSG_NOSIGNAL)
		for _, fd := range fds {
			unix.Close(fd)
		}
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(time.Second):
		fmt.Println("linger: the producer closed first")
	}
	return conn
}

// startLingerAttack starts the attacker against channel name: as nobody,
// in the channel's group when member, in no group of the channel's
// otherwise; it returns once the attacks are done.
func startLingerAttack(t *testing.T, name string, member bool) *proc {
	return startLingerFlood(t, name, member, 0, 0)
}

// startLingerFlood is startLingerAttack followed by a flood of heavy and
// light connections.
func startLingerFlood(t *testing.T, name string, member bool, heavy, light int) *proc {
	exe := testkit.ExecutableForOthers(t)
	attr := testkit.AsUser(testkit.Nobody, testkit.Nobody)
	m := "0"
	if member {
		attr = testkit.AsUser(testkit.Nobody, testkit.Nobody, sharedGid)
		m = "1"
	}
	env := []string{envRole + "=hostile",
		envArgs + "=linger " + joinAddress(t, name) + " " + name + " " + m + " " + fmt.Sprint(heavy, " ", light)}
	a := startAttr(t, "linger attacker", env, attr, exe, "-test.run=^TestHelperHostile$")
	a.waitLine(t, "linger: attacks done", 120*time.Second)
	t.Logf("attacker: %s", a.Output())
	assert.Contains(t, a.Output(), "linger: address listed", "the join address is public")
	assert.Contains(t, a.Output(), fmt.Sprintf("linger: refused with status %d\n", ring.StatusPerm),
		"knowing the address lets no one in")
	return a
}

// closeReturns closes p, failing the test if Close waits 30 s (on a
// descriptor a peer sent).
func closeReturns(t *testing.T, p *producer.Producer) {
	closed := make(chan error, 1)
	start := time.Now()
	go func() { closed <- p.Close() }()
	select {
	case err := <-closed:
		require.NoError(t, err)
		t.Logf("Close took %v", time.Since(start))
	case <-time.After(30 * time.Second):
		t.Fatal("Close still waits after 30 s (on a descriptor a peer sent)")
	}
}

// attachAfterAttack checks that a reader of the channel's user still
// joins.
func attachAfterAttack(t *testing.T, name string) {
	start := time.Now()
	r, err := reader.Attach(name, reader.Options{Start: reader.StartNow, AttachTimeout: 20 * time.Second})
	require.NoError(t, err, "a reader joins after the attacks")
	require.NoError(t, r.Detach())
	t.Logf("attach after the attacks: %v", time.Since(start))
}

// TestLingeringDescriptorsDoNotHoldGoProducer: the Go producer's Close
// returns, and readers still join, while the descriptors that a
// non-member and a member of another uid sent it cannot be closed (before
// the fix Close waited for the goroutine stuck closing one).
func TestLingeringDescriptorsDoNotHoldGoProducer(t *testing.T) {
	testkit.NeedRoot(t)
	for _, member := range []bool{false, true} {
		t.Run(fmt.Sprintf("member=%v", member), func(t *testing.T) {
			name := channel(t)
			p, err := producer.Create(name, producer.Options{Slots: 4, SlotBytes: 4096, Mode: 0o640, Gid: sharedGid})
			require.NoError(t, err)
			startLingerAttack(t, name, member)
			attachAfterAttack(t, name)
			closeReturns(t, p)
		})
	}
}

// TestLingeringDescriptorsDoNotHoldCProducer: the same against the
// libtsock.so producer, which also forks: fork() and
// tsock_producer_close return (before the fix both waited on the fork
// guard's mutex, held by a thread stuck closing such a descriptor).
func TestLingeringDescriptorsDoNotHoldCProducer(t *testing.T) {
	testkit.NeedRoot(t)
	exe := needABIProducer(t)
	for _, member := range []bool{false, true} {
		t.Run(fmt.Sprintf("member=%v", member), func(t *testing.T) {
			name := channel(t)
			p := start(t, "abi hold", nil, exe, "hold", name, fmt.Sprint(sharedGid))
			p.waitLine(t, "ready", 60*time.Second)
			startLingerAttack(t, name, member)
			attachAfterAttack(t, name)
			require.NoError(t, p.cmd.Process.Signal(syscall.SIGUSR1))
			code := p.wait(t, 60*time.Second)
			require.Equal(t, 0, code, "fork and close return (the watchdog kills it after 30 s)\n%s", p.Output())
			assert.Contains(t, p.Output(), "fork took")
			assert.Contains(t, p.Output(), "close took")
		})
	}
}

// TestAttachTimeoutBoundsJoin (review 2, F2): a producer that does not
// answer the join (stopped: SIGSTOP) holds an attach no longer than its
// attach_timeout_ns, or 2 s with 0 (before the fix: 10 s either way).
func TestAttachTimeoutBoundsJoin(t *testing.T) {
	exe := needABIProducer(t)
	name := channel(t)
	p := start(t, "abi hold", nil, exe, "hold", name, fmt.Sprint(os.Getgid()))
	p.waitLine(t, "ready", 60*time.Second)
	require.NoError(t, p.cmd.Process.Signal(syscall.SIGSTOP))
	// kill() returns before the process stops: wait until it has.
	require.Eventually(t, func() bool {
		stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", p.cmd.Process.Pid))
		i := strings.LastIndexByte(string(stat), ')')
		return err == nil && i > 0 && i+2 < len(stat) && stat[i+2] == 'T'
	}, 30*time.Second, 5*time.Millisecond, "the producer stops")
	resumed := false
	defer func() {
		if !resumed {
			_ = p.cmd.Process.Signal(syscall.SIGCONT)
		}
	}()
	for _, c := range []struct {
		timeout, least, bound time.Duration
	}{{time.Second, time.Second, 6 * time.Second}, {0, 2 * time.Second, 7 * time.Second}} {
		start := time.Now()
		r, err := reader.Attach(name, reader.Options{Start: reader.StartNow, AttachTimeout: c.timeout})
		took := time.Since(start)
		if err == nil {
			r.Detach()
		}
		require.Error(t, err, "attach to a stopped producer (took %v)", took)
		assert.ErrorIs(t, err, ring.Status(ring.StatusTimedOut), "%v", err)
		assert.GreaterOrEqual(t, took, c.least, "timeout %v", c.timeout)
		assert.Less(t, took, c.bound, "timeout %v: the join waited past it", c.timeout)
		t.Logf("attach_timeout %v: %v after %v", c.timeout, err, took)
	}
	// Resumed, it answers again.
	require.NoError(t, p.cmd.Process.Signal(syscall.SIGCONT))
	resumed = true
	r, err := reader.Attach(name, reader.Options{Start: reader.StartNow, AttachTimeout: 20 * time.Second})
	require.NoError(t, err)
	require.NoError(t, r.Detach())
	require.NoError(t, p.cmd.Process.Signal(syscall.SIGUSR1))
	require.Equal(t, 0, p.wait(t, 60*time.Second), p.Output())
}

// floodConns is how many connections the flood opens: 30,000 descriptors
// sent, more than the descriptor limit of many hosts.
const floodConns = 15

// peerFdBound is the most descriptors a flood may leave the producer
// holding: the budget (512 at most), the connections given up whole
// beyond it (128) and those not yet handled (a backlog's worth, 128), with
// room for the producer's own.
const peerFdBound = 512 + 128 + 128 + 64

// openFdsOf counts the descriptors process pid has open.
func openFdsOf(t *testing.T, pid int) int {
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	require.NoError(t, err)
	return len(ents)
}

// stuckClosers counts pid's threads blocked closing a lingering socket.
func stuckClosers(pid int) int {
	tasks, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	n := 0
	for _, task := range tasks {
		stack, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/stack", pid, task.Name()))
		if strings.Contains(string(stack), "tcp_close") {
			n++
		}
	}
	return n
}

// checkFloodBounded waits for the producer (process pid) to have handled
// the flood and checks what it holds.
func checkFloodBounded(t *testing.T, a *proc, pid, before int) {
	assert.Contains(t, a.Output(), "linger: flood sent")
	var now int
	for end := time.Now().Add(5 * time.Second); time.Now().Before(end); time.Sleep(100 * time.Millisecond) {
		now = openFdsOf(t, pid)
	}
	t.Logf("producer: %d descriptors before the attack, %d after; %d threads stuck closing", before, now,
		stuckClosers(pid))
	assert.Less(t, now-before, peerFdBound, "the descriptors a peer can make the producer hold are bounded")
}

// TestDescriptorFloodIsBoundedGo (review 4, R1): a non-member sticks the
// discard workers with lingering sockets, then sends 30,000 more
// descriptors. The Go producer holds a bounded number of them (before the
// fix: every one, up to its limit, which then stopped joins and Close);
// a reader still joins, and Close returns.
func TestDescriptorFloodIsBoundedGo(t *testing.T) {
	p, name, _ := floodGoProducer(t, floodConns, 0)
	attachAfterAttack(t, name)
	closeReturns(t, p)
}

// floodGoProducer creates a Go producer (in this process) and floods it
// (startLingerFlood), checking the descriptors it then holds.
func floodGoProducer(t *testing.T, heavy, light int) (*producer.Producer, string, *proc) {
	testkit.NeedRoot(t)
	name := channel(t)
	p, err := producer.Create(name, producer.Options{Slots: 4, SlotBytes: 4096, Mode: 0o640, Gid: sharedGid})
	require.NoError(t, err)
	before := openFdsOf(t, os.Getpid())
	a := startLingerFlood(t, name, false, heavy, light)
	checkFloodBounded(t, a, os.Getpid(), before)
	return p, name, a
}

// TestDescriptorFloodIsBoundedC: the same against the libtsock.so
// producer, whose fork() and tsock_producer_close must return too.
func TestDescriptorFloodIsBoundedC(t *testing.T) {
	testkit.NeedRoot(t)
	exe := needABIProducer(t)
	name := channel(t)
	p := start(t, "abi hold", nil, exe, "hold", name, fmt.Sprint(sharedGid))
	p.waitLine(t, "ready", 60*time.Second)
	before := openFdsOf(t, p.cmd.Process.Pid)
	a := startLingerFlood(t, name, false, floodConns, 0)
	checkFloodBounded(t, a, p.cmd.Process.Pid, before)
	attachAfterAttack(t, name)
	require.NoError(t, p.cmd.Process.Signal(syscall.SIGUSR1))
	code := p.wait(t, 60*time.Second)
	require.Equal(t, 0, code, "fork and close return (the watchdog kills it after 30 s)\n%s", p.Output())
}

// TestDescriptorFloodPastTheBudgetGo: a flood of 4 heavy connections
// and 700 light ones spend the budget; the producer then
// accepts no more connections (they wait in the backlog) while it still
// holds a bounded
// number of descriptors, a reader's attach fails within its timeout with
// a clear error instead of hanging, and Close returns at once (the
// connections still in the backlog are handed over, not closed in its
// thread).
func TestDescriptorFloodPastTheBudgetGo(t *testing.T) {
	p, name, a := floodGoProducer(t, 4, 700)
	assert.Contains(t, a.Output(), "linger: flood: connect:", "the producer stopped accepting")
	start := time.Now()
	r, err := reader.Attach(name, reader.Options{Start: reader.StartNow, AttachTimeout: 2 * time.Second})
	if err == nil {
		r.Detach()
	}
	t.Logf("attach during the flood: %v after %v", err, time.Since(start))
	assert.Less(t, time.Since(start), 10*time.Second, "the attach ends within its timeout")
	closeReturns(t, p)
}
