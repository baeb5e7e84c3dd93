// Package childproc runs the helper processes of tsock's tests, benchmarks
// and demo: it starts a command with its environment, makes it die with
// its parent, keeps what it prints, and waits for it with a bound that
// kills it and says what it printed. Before it, the same harness was
// written in the latency benchmark, the chaos soak, the demo and the
// multi-process tests, each a little different.
package childproc

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// ErrTimedOut is wrapped by the error of Wait when the child outlived its
// bound and was killed.
var ErrTimedOut = errors.New("did not finish in time")

// tailBytes bounds the child's output quoted in Wait's errors.
const tailBytes = 2048

// After the child exits, its output is read on until its pipes end. A
// grandchild that inherited them (a DataLoader worker, a `sleep &`) keeps
// them open, so reading stops once a pipe has been idle for drainIdle (no
// data, nothing being delivered), and drainMax after the exit whatever
// happens: what the child itself wrote is in the pipe by then and is read
// however slow OnLine or the writers are, but Done and Wait do not wait for
// a grandchild.
const (
	drainIdle = 2 * time.Second
	drainMax  = 60 * time.Second
)

// Options says how to run a child. The zero value runs it in this
// process's environment and directory, killed with SIGKILL when its parent
// dies, its stdout read as lines and kept with its stderr.
type Options struct {
	// Label names the child in errors; default the program's base name.
	Label string
	// Env is added to this process's environment.
	Env []string
	// Dir is the child's working directory ("" for this process's).
	Dir string
	// Attr replaces the default process attributes, Pdeathsig SIGKILL.
	// Pdeathsig fires when the thread that started the child ends, not
	// the process: a caller that relies on it keeps its goroutine on one
	// thread (runtime.LockOSThread) while the child lives.
	Attr *syscall.SysProcAttr
	// Stdin, when true, gives the child a pipe for stdin (Process.Stdin).
	Stdin bool
	// Stdout, when set, receives the child's stdout as it is (a binary
	// report, JSON); OnLine is then not called and Output holds stderr
	// only. When nil, stdout is read as lines into Output and OnLine.
	Stdout io.Writer
	// OnLine is called with each stdout line, in order, from one
	// goroutine; Done is closed only after the last call returned.
	OnLine func(line string)
	// Stderr, when set, also receives the child's stderr (it may be
	// written from several children's goroutines: a shared one must be
	// safe for that).
	Stderr io.Writer
	// Keep bounds Output to the last Keep bytes (0: everything), for
	// children that run long and print much.
	Keep int
}

// Process is a started child.
type Process struct {
	// Cmd is the running command, for its pid and for signals.
	Cmd *exec.Cmd
	// Stdin is the pipe to the child's stdin when Options.Stdin was set.
	Stdin io.WriteCloser

	label  string
	keep   int
	exited chan struct{} // closed once the child is reaped (err, ended set)
	done   chan struct{} // closed once its output is read too
	err    error         // from Cmd.Wait, valid once exited is closed
	ended  time.Time     // when Cmd.Wait returned

	mu  sync.Mutex
	out []byte
}

// Start starts name with args as o says.
func Start(name string, args []string, o Options) (*Process, error) {
	p := &Process{
		label: o.Label, keep: o.Keep, Cmd: exec.Command(name, args...),
		exited: make(chan struct{}), done: make(chan struct{}),
	}
	if p.label == "" {
		p.label = filepath.Base(name)
	}
	c := p.Cmd
	c.Env = append(os.Environ(), o.Env...)
	c.Dir = o.Dir
	c.SysProcAttr = o.Attr
	if c.SysProcAttr == nil {
		c.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	}
	// Both outputs go through pipes of our own rather than exec's, whose
	// Wait waits for the end of every pipe (see drainIdle).
	var outs []*stream
	fail := func(err error) (*Process, error) {
		for _, s := range outs {
			s.close()
		}
		return nil, err
	}
	var deliverOut func(*stream)
	if o.Stdout != nil {
		deliverOut = func(s *stream) { s.copyTo(o.Stdout) }
	} else {
		deliverOut = func(s *stream) { s.lines(p.keepOutput, o.OnLine) }
	}
	stdout, err := newStream()
	if err != nil {
		return fail(err)
	}
	outs = append(outs, stdout)
	stderr, err := newStream()
	if err != nil {
		return fail(err)
	}
	outs = append(outs, stderr)
	c.Stdout, c.Stderr = stdout.w, stderr.w
	if o.Stdin {
		if p.Stdin, err = c.StdinPipe(); err != nil {
			return fail(err)
		}
	}
	if err := c.Start(); err != nil {
		return fail(fmt.Errorf("start %s: %w", p.label, err))
	}
	stdout.closeWriter() // the child holds its own copies now
	stderr.closeWriter()
	errTo := p.outputWriter(o.Stderr)
	go stdout.read(deliverOut)
	go stderr.read(func(s *stream) { s.copyTo(errTo) })
	go p.reap(outs)
	return p, nil
}

// reap waits for the child, then for the end of its output (see
// drainIdle), and closes exited and done in turn.
func (p *Process) reap(outs []*stream) {
	p.err = p.Cmd.Wait()
	p.ended = time.Now()
	close(p.exited)
	for _, s := range outs {
		s.drain(p.ended)
	}
	close(p.done)
}

// A stream is one output pipe of the child and the goroutine reading it.
type stream struct {
	r, w   *os.File
	ended  chan struct{} // closed when reading stopped
	busy   atomic.Bool   // a read's data is being delivered
	active atomic.Int64  // UnixNano of the last data read or delivered
}

func newStream() (*stream, error) {
	r, w, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	return &stream{r: r, w: w, ended: make(chan struct{})}, nil
}

func (s *stream) closeWriter() {
	_ = s.w.Close()
	s.w = nil
}

func (s *stream) close() {
	if s.w != nil {
		s.closeWriter()
	}
	_ = s.r.Close()
}

// read runs deliver, which reads the pipe to its end, then closes it.
func (s *stream) read(deliver func(*stream)) {
	defer close(s.ended)
	deliver(s)
	_ = s.r.Close()
}

// Read is the pipe's, marking activity for drain.
func (s *stream) Read(b []byte) (int, error) {
	n, err := s.r.Read(b)
	if n > 0 {
		s.active.Store(time.Now().UnixNano())
	}
	return n, err
}

// delivering marks a delivery under way (or over) for drain.
func (s *stream) delivering(on bool) {
	s.busy.Store(on)
	s.active.Store(time.Now().UnixNano())
}

// copyTo passes every chunk read to w.
func (s *stream) copyTo(w io.Writer) {
	buf := make([]byte, 32<<10)
	for {
		n, err := s.Read(buf)
		if n > 0 {
			s.delivering(true)
			_, _ = w.Write(buf[:n])
			s.delivering(false)
		}
		if err != nil {
			return
		}
	}
}

// lines passes every line read to keep (with its newline) and onLine
// (without). The last one may lack its newline: the child's unterminated
// last output, read when the pipe ended or reading stopped.
func (s *stream) lines(keep func([]byte), onLine func(string)) {
	br := bufio.NewReaderSize(s, 64<<10)
	for {
		line, err := br.ReadString('\n')
		if line != "" {
			s.delivering(true)
			text := strings.TrimSuffix(line, "\n")
			keep([]byte(text + "\n"))
			if onLine != nil {
				onLine(text)
			}
			s.delivering(false)
		}
		if err != nil {
			return
		}
	}
}

// drain waits, once the child has exited, for the pipe's end; or stops
// reading once it has been idle drainIdle, or drainMax after the exit.
func (s *stream) drain(exited time.Time) {
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-s.ended:
			return
		case now := <-tick.C:
			last := time.Unix(0, s.active.Load())
			if last.Before(exited) {
				last = exited
			}
			idle := !s.busy.Load() && now.Sub(last) > drainIdle
			if idle || now.Sub(exited) > drainMax {
				_ = s.r.SetReadDeadline(now) // the read under way returns
				<-s.ended
				return
			}
		}
	}
}

// outputWriter is where the child's stderr goes: Output, and also also.
func (p *Process) outputWriter(also io.Writer) io.Writer {
	w := writerFunc(func(b []byte) (int, error) {
		p.keepOutput(b)
		return len(b), nil
	})
	if also == nil {
		return w
	}
	return io.MultiWriter(w, also)
}

func (p *Process) keepOutput(b []byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.out = append(p.out, b...)
	if p.keep > 0 && len(p.out) > p.keep {
		p.out = append([]byte(nil), p.out[len(p.out)-p.keep:]...)
	}
}

// Serialized returns a writer that passes each Write on to w under a lock:
// for one w (a log, a shared stderr) given as Options.Stderr to several
// children, whose output each child's own goroutine copies.
func Serialized(w io.Writer) io.Writer { return &lockedWriter{w: w} }

type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(b []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(b)
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(b []byte) (int, error) { return f(b) }

// Label is the child's name in errors.
func (p *Process) Label() string { return p.label }

// Pid is the child's process id.
func (p *Process) Pid() int { return p.Cmd.Process.Pid }

// Done is closed once the child has been reaped and its stdout read.
func (p *Process) Done() <-chan struct{} { return p.done }

// Exited reports whether Done is closed.
func (p *Process) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Err is the result of the child's wait (nil for exit status 0); valid
// once Done is closed.
func (p *Process) Err() error { return p.err }

// Ended is when the child was reaped; valid once Done is closed.
func (p *Process) Ended() time.Time { return p.ended }

// ExitCode is the child's exit status, -1 if a signal ended it; valid
// once Done is closed.
func (p *Process) ExitCode() int { return p.Cmd.ProcessState.ExitCode() }

// Output is what the child printed so far: its stdout lines (unless
// Options.Stdout took them) and its stderr, in the order they were read.
func (p *Process) Output() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return string(p.out)
}

// Kill ends the child with SIGKILL, unless it has ended, and waits until
// it is reaped.
func (p *Process) Kill() {
	select {
	case <-p.exited:
	default:
		_ = p.Cmd.Process.Kill()
	}
	<-p.done
}

// Wait waits up to timeout for the child to end. It returns nil on exit
// status 0; otherwise an error naming the child, how it ended and the end
// of what it printed. A child still running at timeout is killed first,
// and the error wraps ErrTimedOut.
func (p *Process) Wait(timeout time.Duration) error {
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-p.exited:
	case <-t.C:
		select {
		case <-p.exited: // both ready (select picks either): the child has ended
		default:
			p.Kill()
			return p.failure(fmt.Errorf("%w (%v)", ErrTimedOut, timeout))
		}
	}
	<-p.done // the rest of its output (see drainIdle)
	if p.err != nil {
		return p.failure(p.err)
	}
	return nil
}

// failure is err about this child, with the end of its output.
func (p *Process) failure(err error) error {
	said := strings.TrimSpace(p.Output())
	if len(said) > tailBytes {
		said = "..." + said[len(said)-tailBytes:]
	}
	if said == "" {
		return fmt.Errorf("%s pid %d: %w", p.label, p.Pid(), err)
	}
	return fmt.Errorf("%s pid %d: %w; it printed:\n%s", p.label, p.Pid(), err, said)
}
