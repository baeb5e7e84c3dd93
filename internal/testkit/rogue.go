package testkit

import (
	"errors"
	"fmt"
	"os"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/tsock/tsock/ring"
)

// A Rogue is a reader that speaks the join protocol itself, without the
// library, and then does what it likes with what it was given: its own
// record (a memfd) and its connection. It is what a buggy or hostile
// reader process can do to a channel it may read, and nothing more.
type Rogue struct {
	Conn  int // the connection to the producer
	RecFd int // the record's memfd
	Rec   *ring.Record
	Reply ring.JoinReplyMsg
}

// Dial connects to channel name's join socket, with a timeout on every
// later send and receive; the caller closes the descriptor.
func Dial(name string) (int, error) {
	seg, err := ring.OpenSegment(name)
	if err != nil {
		return -1, err
	}
	key := seg.JoinKey()
	seg.Close()
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	tv := unix.NsecToTimeval(int64(10 * time.Second))
	_ = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	_ = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_SNDTIMEO, &tv)
	addr := ring.JoinAddress(key)
	if err := unix.Connect(fd, &unix.SockaddrUnix{Name: "@" + addr[1:]}); err != nil {
		unix.Close(fd)
		return -1, err
	}
	return fd, nil
}

// SendRequest sends request bytes with the descriptors fds.
func SendRequest(conn int, req []byte, fds ...int) error {
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	return unix.Sendmsg(conn, req, oob, nil, unix.MSG_NOSIGNAL)
}

// ReadReply receives the producer's reply and the descriptor it carries
// (-1 if none). io.EOF-like: n == 0 when the producer closed the
// connection instead.
func ReadReply(conn int) (ring.JoinReplyMsg, int, error) {
	buf := make([]byte, 256)
	oob := make([]byte, unix.CmsgSpace(4*4))
	n, oobn, _, _, err := unix.Recvmsg(conn, buf, oob, unix.MSG_CMSG_CLOEXEC)
	if err != nil {
		return ring.JoinReplyMsg{}, -1, err
	}
	if n == 0 {
		return ring.JoinReplyMsg{}, -1, errClosed
	}
	fd := -1
	if msgs, err := unix.ParseSocketControlMessage(oob[:oobn]); err == nil {
		for i := range msgs {
			fds, err := unix.ParseUnixRights(&msgs[i])
			for k := 0; err == nil && k < len(fds); k++ {
				if fd < 0 {
					fd = fds[k]
				} else {
					unix.Close(fds[k])
				}
			}
		}
	}
	rep, ok := ring.ParseJoinReply(buf[:n])
	if !ok {
		if fd >= 0 {
			unix.Close(fd)
		}
		return rep, -1, fmt.Errorf("reply of %d bytes", n)
	}
	return rep, fd, nil
}

var errClosed = errors.New("the producer closed the connection")

// JoinRogue attaches to channel name as a reader would (start mode mode),
// proving access with a read-only descriptor of the segment, and maps the
// record it gets read-write.
func JoinRogue(name string, mode uint32) (*Rogue, error) {
	seg, err := os.Open(ring.ChannelPath(name))
	if err != nil {
		return nil, err
	}
	defer seg.Close()
	conn, err := Dial(name)
	if err != nil {
		return nil, err
	}
	if err := SendRequest(conn, ring.NewJoinRequest(mode).Bytes(), int(seg.Fd())); err != nil {
		unix.Close(conn)
		return nil, err
	}
	rep, fd, err := ReadReply(conn)
	if err == nil && rep.Status != int32(ring.StatusOK) {
		err = ring.Status(int(rep.Status))
	}
	if err == nil && fd < 0 {
		err = errors.New("no record in the reply")
	}
	if err != nil {
		if fd >= 0 {
			unix.Close(fd)
		}
		unix.Close(conn)
		return nil, err
	}
	rec, err := ring.MapRecord(fd, true)
	if err != nil {
		unix.Close(fd)
		unix.Close(conn)
		return nil, err
	}
	return &Rogue{Conn: conn, RecFd: fd, Rec: rec, Reply: rep}, nil
}

// Word is the 64-bit word at byte off of the record.
func (r *Rogue) Word(off uintptr) *uint64 {
	return (*uint64)(unsafe.Pointer(&r.Rec.Bytes()[off]))
}

// Set stores v at byte off of the record (atomic).
func (r *Rogue) Set(off uintptr, v uint64) { atomic.StoreUint64(r.Word(off), v) }

// SetSleeping sets or clears the record's sleeping flag.
func (r *Rogue) SetSleeping(on bool) {
	var v uint32
	if on {
		v = 1
	}
	atomic.StoreUint32((*uint32)(unsafe.Pointer(&r.Rec.Bytes()[ring.RecordOffSleeping])), v)
}

// Send sends one message on the connection without blocking.
func (r *Rogue) Send(b []byte) error {
	_, err := unix.SendmsgN(r.Conn, b, nil, nil, unix.MSG_DONTWAIT|unix.MSG_NOSIGNAL)
	return err
}

// Truncate tries to resize the record's file (the seals refuse it).
func (r *Rogue) Truncate(size int64) error { return unix.Ftruncate(r.RecFd, size) }

// Close drops the connection (the producer frees the entry) and the record.
func (r *Rogue) Close() {
	if r.Conn >= 0 {
		unix.Close(r.Conn)
		r.Conn = -1
	}
	if r.Rec != nil {
		r.Rec.Unmap()
		r.Rec = nil
	}
	if r.RecFd >= 0 {
		unix.Close(r.RecFd)
		r.RecFd = -1
	}
}

// IsTimeout reports whether a receive ran into its timeout.
func IsTimeout(err error) bool { return errors.Is(err, syscall.EAGAIN) }
