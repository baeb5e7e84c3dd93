// Package readers is the producer's side of its readers: the join socket
// it listens on, the join handshake, each reader's record (a sealed memfd
// the reader alone writes), the roster in the segment (which only the
// producer writes), each reader's liveness (its connection: end of file
// means it is gone), and where the producer sleeps while it waits for
// them (the cursor word of the reader that holds it back).
// docs/ARCHITECTURE.md, "Joining" and "Publish", describes the protocol;
// layout.h defines its messages and structs.
//
// The producer uses a Table; tests that craft a segment by hand use one to
// let readers attach to it.
package readers

import (
	"crypto/rand"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tsock/tsock/ring"
)

// Guard keeps descriptors out of children forked without exec (see
// producer.ForkGuard): Open runs open, which makes one descriptor, with
// fork() held off until the guard knows it; Close closes one the same way.
type Guard interface {
	Open(open func() (*os.File, error)) (*os.File, error)
	Close(f *os.File) error
}

// NoGuard is the Guard of a program that cannot fork without exec (Go).
type NoGuard struct{}

func (NoGuard) Open(open func() (*os.File, error)) (*os.File, error) { return open() }
func (NoGuard) Close(f *os.File) error                               { return f.Close() }

// Limits of the join.
const (
	// HandshakeTimeout bounds how long a connection may take to send its
	// request: a client that connects and says nothing is dropped then.
	HandshakeTimeout = 5 * time.Second
	// PendingPerUID and PendingTotal bound the connections not yet joined:
	// one user's flood of silent connections is closed at once beyond its
	// share and cannot keep another user's readers out.
	PendingPerUID = 16
	PendingTotal  = 128
	listenBacklog = 128
)

// entry is one roster entry as the producer knows it.
type entry struct {
	state uint32 // ring.ReaderFree, ReaderActive or ReaderEvicted
	gen   uint64
	rec   *ring.Record
	id    ring.Identity
}

// Table is the producer's view of its readers.
type Table struct {
	seg      *ring.Segment
	guard    Guard
	segDev   uint64
	segIno   uint64
	ln       *os.File
	sleepOn  atomic.Pointer[uint32] // the cursor word the producer sleeps on, if it does
	lnDone   chan struct{}
	wg       sync.WaitGroup
	stopOnce sync.Once
	stop     chan struct{}

	mu          sync.Mutex
	entries     []entry
	active      []uint32 // entries that gate the producer, in no order
	conns       map[*os.File]struct{}
	pending     map[uint32]int // connections not yet joined, per peer uid
	npending    int
	serving     bool
	joinsClosed bool
	closed      bool
	// gated is the highest minimum Gating has returned: the producer's
	// cached minimum is one of those, so no batch at or above it is safe
	// from being rewritten without another scan (oldestHeld).
	gated uint64
}

// Listen makes the join socket of seg, a segment being built, and records
// its key in the header (before ring.Segment.InitHeader publishes it).
// Nothing is accepted before Serve.
func Listen(seg *ring.Segment, guard Guard) (*Table, error) {
	if guard == nil {
		guard = NoGuard{}
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(seg.File.Fd()), &st); err != nil {
		return nil, fmt.Errorf("stat the segment: %w", err)
	}
	t := &Table{seg: seg, guard: guard, segDev: st.Dev, segIno: st.Ino, lnDone: make(chan struct{}),
		stop: make(chan struct{}), entries: make([]entry, seg.Readers), conns: map[*os.File]struct{}{},
		pending: map[uint32]int{}}
	for attempt := 0; ; attempt++ {
		var key [16]byte
		if _, err := rand.Read(key[:]); err != nil {
			return nil, fmt.Errorf("random join key: %w", err)
		}
		ln, err := guard.Open(func() (*os.File, error) { return listenAt(ring.JoinAddress(key)) })
		if errors.Is(err, unix.EADDRINUSE) && attempt < 8 {
			continue // 128 random bits taken: someone squats; draw again
		}
		if err != nil {
			return nil, fmt.Errorf("join socket: %w", err)
		}
		t.ln = ln
		seg.SetJoinKey(key)
		return t, nil
	}
}

// listenAt makes a non-blocking SOCK_SEQPACKET listener on the abstract
// address addr (which starts with its NUL).
func listenAt(addr string) (*os.File, error) {
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	if err := unix.Bind(fd, &unix.SockaddrUnix{Name: "@" + addr[1:]}); err != nil {
		unix.Close(fd)
		return nil, err
	}
	if err := unix.Listen(fd, listenBacklog); err != nil {
		unix.Close(fd)
		return nil, err
	}
	return os.NewFile(uintptr(fd), "tsock-join"), nil
}

// Serve starts accepting readers and mirroring their records into the
// roster.
func (t *Table) Serve() {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.serving || t.joinsClosed {
		return
	}
	t.serving = true
	t.wg.Add(2)
	go t.acceptLoop()
	go t.mirrorLoop()
}

// Wait sleeps on the cursor word of the reader that holds the producer
// back, while it still reads val, for at most d: its release changes the
// word and wakes it (see Gating); so does its death, and Poke.
func (t *Table) Wait(word *uint32, val uint32, d time.Duration) {
	t.sleepOn.Store(word)
	ring.FutexWait(word, val, d)
	t.sleepOn.Store(nil)
}

// Poke wakes a producer asleep in Wait (Close). A poke that comes between
// the producer's last look and its sleep is lost: it then sleeps its
// slice out, which is why Wait's callers bound it.
func (t *Table) Poke() {
	if w := t.sleepOn.Load(); w != nil {
		ring.FutexWakeAll(w)
	}
}

// StopJoins closes the join socket: no reader attaches any more (Close's
// first step; the readers attached stay until Close).
func (t *Table) StopJoins() {
	t.mu.Lock()
	already, serving := t.joinsClosed, t.serving
	t.joinsClosed = true
	t.mu.Unlock()
	if already {
		return
	}
	if !serving {
		t.closeListener()
		return
	}
	_ = t.ln.SetReadDeadline(time.Unix(1, 0))
	<-t.lnDone
}

// Close ends every connection and unmaps every record, leaving the roster
// as it is (readers still attached drain a closed channel and go by its
// state). The segment must stay mapped until Close returns.
func (t *Table) Close() {
	t.StopJoins()
	t.mu.Lock()
	t.closed = true
	for c := range t.conns {
		_ = c.SetDeadline(time.Unix(1, 0))
	}
	t.mu.Unlock()
	t.stopOnce.Do(func() { close(t.stop) })
	t.wg.Wait()
	t.mu.Lock()
	defer t.mu.Unlock()
	for i := range t.entries {
		if t.entries[i].rec != nil {
			t.entries[i].rec.Unmap()
			t.entries[i].rec = nil
		}
	}
	t.active = nil
}

// ---- accepting ----

func (t *Table) joinsStopped() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.joinsClosed
}

func (t *Table) acceptLoop() {
	defer t.wg.Done()
	defer close(t.lnDone)
	rc, err := t.ln.SyscallConn()
	if err != nil {
		t.guard.Close(t.ln)
		return
	}
	defer t.closeListener()
	for {
		if overdrawn() {
			// Peers' descriptors fill the budget: connections wait in
			// the backlog until the discard workers catch up.
			if t.joinsStopped() {
				return
			}
			time.Sleep(10 * time.Millisecond)
			continue
		}
		var conn *os.File
		var aerr error
		rerr := rc.Read(func(fd uintptr) bool {
			conn, aerr = t.accept(int(fd))
			return !errors.Is(aerr, unix.EAGAIN)
		})
		if rerr != nil {
			return // StopJoins
		}
		switch {
		case aerr == nil:
			t.admit(conn)
		case errors.Is(aerr, unix.EMFILE) || errors.Is(aerr, unix.ENFILE) || errors.Is(aerr, unix.ENOMEM) ||
			errors.Is(aerr, unix.ENOBUFS):
			time.Sleep(10 * time.Millisecond) // out of descriptors: the connection waits in the backlog
		}
	}
}

// accept takes one connection from the listener ln. Accepted with fork()
// held off, so the connection is known to the guard from its first
// instant; non-blocking, so the hold is never long.
func (t *Table) accept(ln int) (*os.File, error) {
	return t.guard.Open(func() (*os.File, error) {
		nfd, _, err := unix.Accept4(ln, unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC)
		if err != nil {
			return nil, err
		}
		return os.NewFile(uintptr(nfd), "tsock-reader"), nil
	})
}

// closeListener closes the join socket. Shut down, it refuses new
// connections (and those blocked in connect() on its full backlog); those
// still in its backlog are accepted and handed over
// (closeConn), which ends each at once for the reader waiting on it (only
// the listener's last close would end them otherwise, and that happens on
// a discard worker, which a peer may hold). The listener itself is then
// handed over whole, as it may still queue connections that arrived
// meanwhile, or that could not be accepted (no descriptor free).
func (t *Table) closeListener() {
	if rc, err := t.ln.SyscallConn(); err == nil {
		_ = rc.Control(func(fd uintptr) {
			_ = unix.Shutdown(int(fd), unix.SHUT_RDWR)
			// listen() again wakes every connect() still blocked on the
			// full backlog (the kernel wakes them one per accept
			// otherwise): refused now, they end at once.
			_ = unix.Listen(int(fd), listenBacklog+1)
			for range listenBacklog + 1 {
				conn, err := t.accept(int(fd))
				if err != nil {
					return // none left, or no descriptor free
				}
				t.closeConn(conn)
			}
		})
	}
	if !handOver(t.ln, t.guard.Close) {
		strand(t.ln)
	}
}

// closeConn closes a connection: handed over whole, as it may queue a
// peer's descriptors (a child forked meanwhile that inherits the
// duplicate has a dead end: the connection is shut down), or, failing
// that, kept open.
func (t *Table) closeConn(conn *os.File) {
	if !handOver(conn, t.guard.Close) {
		strand(conn)
	}
}

// RawFD is f's descriptor number, -1 once f is closed. Not f.Fd(), which
// puts a socket the runtime polls (a reader's connection) into blocking
// mode, where deadlines no longer work.
func RawFD(f *os.File) int {
	rc, err := f.SyscallConn()
	if err != nil {
		return -1
	}
	fd := -1
	if rc.Control(func(d uintptr) { fd = int(d) }) != nil {
		return -1
	}
	return fd
}

// admit starts the join of a new connection, or closes it at once when
// its user already has its share of connections not yet joined.
func (t *Table) admit(conn *os.File) {
	cred, err := peerCred(conn)
	t.mu.Lock()
	ok := err == nil && !t.joinsClosed && t.pending[cred.Uid] < PendingPerUID && t.npending < PendingTotal
	if ok {
		t.pending[cred.Uid]++
		t.npending++
		t.conns[conn] = struct{}{}
	}
	t.mu.Unlock()
	if !ok {
		t.closeConn(conn)
		return
	}
	t.wg.Add(1)
	go t.serveConn(conn, cred)
}

func peerCred(conn *os.File) (*unix.Ucred, error) {
	rc, err := conn.SyscallConn()
	if err != nil {
		return nil, err
	}
	var cred *unix.Ucred
	var cerr error
	if err := rc.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return nil, err
	}
	return cred, cerr
}

// serveConn joins one reader and then watches its connection until it
// ends.
func (t *Table) serveConn(conn *os.File, cred *unix.Ucred) {
	defer t.wg.Done()
	i, ok := t.join(conn, cred)
	t.mu.Lock()
	t.pending[cred.Uid]--
	if t.pending[cred.Uid] == 0 {
		delete(t.pending, cred.Uid)
	}
	t.npending--
	t.mu.Unlock()
	if ok {
		t.watch(i, conn)
	}
	t.mu.Lock()
	delete(t.conns, conn)
	t.mu.Unlock()
	t.closeConn(conn)
}

// ---- the join ----

// errRefused is a request the producer answers with a status and no record.
type errRefused struct {
	status int
	why    string
}

func (e *errRefused) Error() string { return e.why }

// join reads the request, checks it, gives the reader an entry and its
// record, and answers. It reports the entry and whether the reader joined.
func (t *Table) join(conn *os.File, cred *unix.Ucred) (uint32, bool) {
	t.setDeadline(conn, time.Now().Add(HandshakeTimeout))
	req, err := t.readRequest(conn)
	if err != nil {
		var ref *errRefused
		if errors.As(err, &ref) {
			t.reply(conn, ring.JoinReplyMsg{Status: int32(ref.status)}, nil)
		}
		return 0, false
	}
	recFile, err := t.guard.Open(ring.NewRecordFile)
	if err != nil {
		t.reply(conn, ring.JoinReplyMsg{Status: int32(ring.StatusNoMem)}, nil)
		return 0, false
	}
	defer t.guard.Close(recFile)
	rec, err := ring.MapRecord(int(recFile.Fd()), true)
	if err != nil {
		t.reply(conn, ring.JoinReplyMsg{Status: int32(ring.StatusNoMem)}, nil)
		return 0, false
	}
	id := ring.Identity{Pid: cred.Pid, Uid: cred.Uid, Gid: cred.Gid, StartTime: ring.ProcStartTime(int(cred.Pid)),
		StartMode: req.StartMode}
	rep, st := t.install(rec, id)
	if st != ring.StatusOK {
		rec.Unmap()
		t.reply(conn, ring.JoinReplyMsg{Status: int32(st)}, nil)
		return 0, false
	}
	// From here on only the reader writes the record (until it is gone).
	if err := t.reply(conn, rep, recFile); err != nil {
		t.free(rep.Index, true)
		return 0, false
	}
	t.setDeadline(conn, time.Time{})
	return rep.Index, true
}

// setDeadline sets conn's deadline unless Close has already set it to make
// every connection's goroutine return (under mu, as Close does it).
func (t *Table) setDeadline(conn *os.File, d time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !t.closed {
		_ = conn.SetDeadline(d)
	}
}

// readRequest receives the join request and its descriptor and checks
// both: the descriptor must be this segment, opened for reading (checked
// on a copy before the request is received: see recvPeer). The
// descriptors a request carries are not the fork guard's: received with
// fork() held off, any the kernel could not deliver would be closed in
// this thread with the hold taken. A child forked while one is open
// keeps a copy (see docs/ARCHITECTURE.md, "fork()").
func (t *Table) readRequest(conn *os.File) (ring.JoinRequestMsg, error) {
	rc, err := conn.SyscallConn()
	if err != nil {
		return ring.JoinRequestMsg{}, err
	}
	buf := make([]byte, 2*ring.JoinRequestSize)
	var m message
	var rerr error
	err = rc.Read(func(fd uintptr) bool {
		m, rerr = recvPeer(int(fd), buf, func(d int) bool { return t.checkSegmentFd(d) == nil })
		return !errors.Is(rerr, unix.EAGAIN)
	})
	if err != nil {
		return ring.JoinRequestMsg{}, err // deadline: the client said nothing
	}
	switch {
	case errors.Is(rerr, errForeignDescriptor):
		return ring.JoinRequestMsg{}, &errRefused{ring.StatusPerm, "descriptor of another file"}
	case errors.Is(rerr, errDescriptors):
		return ring.JoinRequestMsg{}, &errRefused{ring.StatusInval, "join request with more than one descriptor"}
	case errors.Is(rerr, errNoDescriptorFree):
		// Out of descriptors for now: the reader retries within its
		// attach timeout.
		return ring.JoinRequestMsg{}, &errRefused{ring.StatusAgain, "no descriptor free"}
	case rerr != nil:
		return ring.JoinRequestMsg{}, rerr
	}
	if len(m.fds) != 1 {
		discard(m.fds...)
		return ring.JoinRequestMsg{}, &errRefused{ring.StatusInval, fmt.Sprintf("join request with %d descriptors", len(m.fds))}
	}
	// This segment's own file (checked on the copy the look made; on
	// tmpfs, which this process holds open): its close cannot block.
	closeTrusted(m.fds[0])
	req, ok := ring.ParseJoinRequest(buf[:m.n])
	switch {
	case !ok || m.truncated || req.Magic != ring.JoinMagic:
		return req, &errRefused{ring.StatusInval, "malformed join request"}
	case req.LayoutVersion != ring.LayoutVersion:
		return req, &errRefused{ring.StatusVersion, "other layout version"}
	case req.Reserved != 0 || req.StartMode > startOldest:
		return req, &errRefused{ring.StatusInval, "bad join request fields"}
	}
	return req, nil
}

// Start modes of tsock.h (tsock_start).
const (
	startNextEpoch = 0
	startNow       = 1
	startOldest    = 2
)

// checkSegmentFd accepts a descriptor of this segment's inode that is open
// for reading: whoever sent it could open the file (or was given it by
// someone who could), so the file's permission bits decide who attaches.
// An O_PATH descriptor proves nothing (it needs no permission on the file).
//
// Nothing here waits on the file's filesystem (a peer's descriptor may be
// of a FUSE mount that never answers): the flags are the descriptor's,
// and statx is told to use what the kernel has cached.
func (t *Table) checkSegmentFd(fd int) error {
	fl, err := unix.FcntlInt(uintptr(fd), unix.F_GETFL, 0)
	if err != nil {
		return &errRefused{ring.StatusPerm, "descriptor flags"}
	}
	if fl&unix.O_PATH != 0 || (fl&unix.O_ACCMODE != unix.O_RDONLY && fl&unix.O_ACCMODE != unix.O_RDWR) {
		return &errRefused{ring.StatusPerm, "descriptor not open for reading"}
	}
	var st unix.Statx_t
	err = unix.Statx(fd, "", unix.AT_EMPTY_PATH|unix.AT_STATX_DONT_SYNC, unix.STATX_INO|unix.STATX_TYPE, &st)
	if err != nil || unix.Mkdev(st.Dev_major, st.Dev_minor) != t.segDev || st.Ino != t.segIno ||
		st.Mode&unix.S_IFMT != unix.S_IFREG {
		return &errRefused{ring.StatusPerm, "descriptor of another file"}
	}
	return nil
}

// reply sends rep (magic and version filled in) with rec's descriptor.
func (t *Table) reply(conn *os.File, rep ring.JoinReplyMsg, rec *os.File) error {
	rep.Magic, rep.LayoutVersion = ring.JoinMagic, ring.LayoutVersion
	var oob []byte
	if rec != nil {
		oob = unix.UnixRights(int(rec.Fd()))
	}
	rc, err := conn.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	err = rc.Write(func(fd uintptr) bool {
		serr = unix.Sendmsg(int(fd), rep.Bytes(), oob, nil, unix.MSG_NOSIGNAL|unix.MSG_DONTWAIT)
		return !errors.Is(serr, unix.EAGAIN)
	})
	if err != nil {
		return err
	}
	return serr
}

// install gives a reader a free entry and its start, and makes it gate the
// producer, under the lock the producer's gating scan takes: every scan
// either sees the reader or happened before, and then the minimum it left
// the producer is at most what was published when the reader started
// (docs/ARCHITECTURE.md, "Joining").
func (t *Table) install(rec *ring.Record, id ring.Identity) (ring.JoinReplyMsg, int) {
	t.mu.Lock()
	if t.joinsClosed || t.closed {
		t.mu.Unlock()
		return ring.JoinReplyMsg{}, ring.StatusClosed
	}
	i := uint32(0)
	for i < uint32(len(t.entries)) && t.entries[i].state != ring.ReaderFree {
		i++
	}
	if i == uint32(len(t.entries)) {
		t.mu.Unlock()
		return ring.JoinReplyMsg{}, ring.StatusFull
	}
	published := t.seg.Published()
	start, epochStart, window := published, t.seg.EpochStart(), t.seg.JoinWindow()
	if id.StartMode == startOldest {
		start = t.oldestHeld(published)
	}
	inWindow := id.StartMode == startNextEpoch && window > 0 && epochStart < published &&
		published-epochStart <= window
	if inWindow {
		start = epochStart
	}
	rec.SetStart(start)
	e := &t.entries[i]
	e.gen++
	id.AttachNs = ring.MonotonicNs()
	e.state, e.rec, e.id = ring.ReaderActive, rec, id
	t.active = append(t.active, i)
	claim := ring.MakeClaim(e.gen, ring.ReaderActive)
	t.seg.SetIdentity(i, id)
	t.seg.Mirror(i, rec.Progress())
	t.seg.SetClaim(i, claim)
	t.mu.Unlock()
	if inWindow {
		// The window's first batch was kept while the epoch had at most
		// `window` batches out: if it still says so now that our cursor
		// is visible, every later scan keeps it for us; else move up to
		// what was published when we joined (docs/ARCHITECTURE.md,
		// "Late join window").
		if t.seg.EpochStart() != epochStart || t.seg.Published()-epochStart > window {
			start, inWindow = published, false
			rec.SetStart(start)
		}
	}
	rep := ring.JoinReplyMsg{Claim: claim, Start: start, Index: i}
	if inWindow {
		rep.Flags = ring.JoinInWindow
	}
	return rep, ring.StatusOK
}

// watch reads the reader's connection until it ends: a leave, or the end
// of the connection (the reader died), frees its entry. Nothing else a
// reader sends means anything.
func (t *Table) watch(i uint32, conn *os.File) {
	buf := make([]byte, 256)
	left := false
	rc, err := conn.SyscallConn()
	for err == nil && !left {
		var m message
		var rerr error
		err = rc.Read(func(fd uintptr) bool {
			// A message with descriptors is not received (a read()
			// would make the kernel close them here, where their close
			// can block): it ends the connection, as the reader's death
			// would.
			m, rerr = recvPeer(int(fd), buf, nil)
			return !errors.Is(rerr, unix.EAGAIN)
		})
		if err == nil && rerr == nil && m.n == 0 && len(m.fds) == 0 {
			break // end of the connection: the reader is gone
		}
		if err == nil && rerr != nil && !errors.Is(rerr, unix.EINTR) {
			break
		}
		for _, b := range buf[:m.n] {
			left = left || b == ring.MsgLeave
		}
	}
	// A reader that left waits for us to close: its entry is free by then.
	t.free(i, left)
}

// free ends entry i's ownership: a reader that left cleanly or died (its
// entry counts as reclaimed).
func (t *Table) free(i uint32, left bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return // the roster stays as it was: readers drain a closed channel
	}
	e := &t.entries[i]
	t.deactivate(i)
	if e.rec != nil {
		e.rec.Unblock() // the producer may be asleep waiting for it
		e.rec.Unmap()
		e.rec = nil
	}
	e.state = ring.ReaderFree
	t.seg.SetClaim(i, ring.MakeClaim(e.gen, ring.ReaderFree))
	if !left {
		t.seg.AddReclaimed()
	}
}

// deactivate removes i from the entries that gate (under mu).
func (t *Table) deactivate(i uint32) {
	for k, a := range t.active {
		if a == i {
			t.active[k] = t.active[len(t.active)-1]
			t.active = t.active[:len(t.active)-1]
			return
		}
	}
}

// ---- what the producer asks ----

// clamp bounds a reader-written cursor into what it can mean at seq: a
// cursor above seq counts as seq, one more than a ring behind as one ring
// behind (the same as a slow reader).
func clamp(cur, seq, slots uint64) uint64 {
	cur = min(cur, seq)
	if seq >= slots && cur < seq-slots {
		cur = seq - slots
	}
	return cur
}

// oldestHeld is where a TSOCK_START_OLDEST reader starts, with published
// batches out: the least cursor of the readers that gate (the oldest batch
// one of them has not released), and published with no reader; never
// below the highest minimum a gating scan has returned, which the
// producer may hold as its cached minimum and write past without another
// scan (review 30, F1: a reader that raised its cursor for a scan, then
// lowered it, had the new reader's first batch rewritten under it); and
// no lower than published - slots + 1 (the slot of published - slots may
// be being rewritten now). Called under t.mu, as the gating scans are: a
// scan after the install sees the new cursor (docs/ARCHITECTURE.md,
// "Joining"). With honest readers the highest minimum is the least
// cursor's (cursors only grow), and the start is that reader's next batch.
func (t *Table) oldestHeld(published uint64) uint64 {
	slots := uint64(t.seg.SlotCount)
	least := published
	for _, i := range t.active {
		least = min(least, clamp(t.entries[i].rec.Cursor(), published, slots))
	}
	least = max(least, min(t.gated, published))
	if published >= slots && least <= published-slots {
		least = published - slots + 1
	}
	return least
}

// Gating is the least of least and the (clamped) cursors of the readers
// that gate, at seq in a ring of slots; and, when a reader's cursor is
// that least, where to sleep until it moves: its cursor word, and the
// value read there.
func (t *Table) Gating(least, seq, slots uint64) (min uint64, word *uint32, val uint32) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, i := range t.active {
		rec := t.entries[i].rec
		raw := rec.Cursor()
		if cur := clamp(raw, seq, slots); cur < least || (cur == least && word == nil) {
			least, word, val = cur, rec.CursorWord(), uint32(raw)
		}
	}
	t.gated = max(t.gated, least)
	return least, word, val
}

// AnySleeping reports whether an attached reader may be asleep on
// published: one load of each one's own flag, so a reader can make the
// producer wake sleepers, never keep it from waking another.
func (t *Table) AnySleeping() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, i := range t.active {
		if t.entries[i].rec.Sleeping() {
			return true
		}
	}
	return false
}

// Evict takes every gating reader whose cursor is least off the gate and
// marks its entry evicted; it returns how many.
func (t *Table) Evict(least, seq, slots uint64) int {
	t.mu.Lock()
	defer t.mu.Unlock()
	n := 0
	for k := 0; k < len(t.active); {
		i := t.active[k]
		e := &t.entries[i]
		if clamp(e.rec.Cursor(), seq, slots) != least {
			k++
			continue
		}
		t.deactivate(i)
		e.state = ring.ReaderEvicted
		t.seg.SetClaim(i, ring.MakeClaim(e.gen, ring.ReaderEvicted))
		t.seg.AddEvicted()
		n++
	}
	return n
}

// Info describes one reader.
type Info struct {
	Index uint32
	ring.Identity
	ring.Progress // read from its record now
	Evicted       bool
	Sleeping      bool
	Attached      bool // it says its attach has completed (it gates from the join on)
}

// Readers lists the readers that joined (evicted ones too, until they go).
func (t *Table) Readers() []Info {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []Info
	for i := range t.entries {
		e := &t.entries[i]
		if e.state == ring.ReaderFree || e.rec == nil {
			continue
		}
		out = append(out, Info{Index: uint32(i), Identity: e.id, Progress: e.rec.Progress(),
			Evicted: e.state == ring.ReaderEvicted, Sleeping: e.rec.Sleeping(), Attached: e.rec.Attached()})
	}
	return out
}

// ---- the roster for tools ----

func (t *Table) mirrorLoop() {
	defer t.wg.Done()
	tick := time.NewTicker(ring.MirrorPeriod)
	defer tick.Stop()
	for {
		select {
		case <-t.stop:
			return
		case <-tick.C:
			t.mirror()
		}
	}
}

// mirror copies every attached reader's progress into its roster entry.
func (t *Table) mirror() {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return
	}
	for i := range t.entries {
		if e := &t.entries[i]; e.state != ring.ReaderFree && e.rec != nil {
			t.seg.Mirror(uint32(i), e.rec.Progress())
		}
	}
}
