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
	"syscall"
	"time"
)

// ErrTimedOut is wrapped by the error of Wait when the child outlived its
// bound and was killed.
var ErrTimedOut = errors.New("did not finish in time")

// tailBytes bounds the child's output quoted in Wait's errors.
const tailBytes = 2048

// drainDelay bounds how long the child's output is still read after the
// child has exited: a grandchild that inherited its stdout or stderr (a
// DataLoader worker, a `sleep &`) keeps the pipe open, and Done and Wait's
// bound must not wait for it.
const drainDelay = 2 * time.Second

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

	label string
	keep  int
	done  chan struct{}
	err   error     // from Cmd.Wait, valid once done is closed
	ended time.Time // when Cmd.Wait returned

	mu  sync.Mutex
	out []byte
}

// Start starts name with args as o says.
func Start(name string, args []string, o Options) (*Process, error) {
	p := &Process{label: o.Label, keep: o.Keep, done: make(chan struct{}), Cmd: exec.Command(name, args...)}
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
	c.Stderr = p.outputWriter(o.Stderr)
	c.WaitDelay = drainDelay
	// Stdout is our own pipe rather than Cmd.StdoutPipe: exec requires
	// such a pipe be read to its end before Wait, and its end may never
	// come (see drainDelay).
	var stdout *os.File
	if o.Stdout != nil {
		c.Stdout = o.Stdout
	} else {
		r, w, err := os.Pipe()
		if err != nil {
			return nil, err
		}
		c.Stdout, stdout = w, r
		defer w.Close() // the child holds its own copy once started
	}
	if o.Stdin {
		var err error
		if p.Stdin, err = c.StdinPipe(); err != nil {
			closeFile(stdout)
			return nil, err
		}
	}
	if err := c.Start(); err != nil {
		closeFile(stdout)
		return nil, fmt.Errorf("start %s: %w", p.label, err)
	}
	go p.reap(stdout, o.OnLine)
	return p, nil
}

func closeFile(f *os.File) {
	if f != nil {
		_ = f.Close()
	}
}

// reap reads the child's stdout lines (when piped) and waits for the
// child; Done closes once both are over, or drainDelay after the child
// exited if something else still holds its stdout.
func (p *Process) reap(stdout *os.File, onLine func(string)) {
	read := make(chan struct{})
	if stdout != nil {
		go p.readLines(stdout, onLine, read)
	} else {
		close(read)
	}
	p.err = p.Cmd.Wait()
	if errors.Is(p.err, exec.ErrWaitDelay) {
		p.err = nil // it exited 0; something it started still holds stderr
	}
	p.ended = time.Now()
	select {
	case <-read:
	case <-time.After(drainDelay):
		_ = stdout.SetReadDeadline(time.Now()) // ends the read under way
		<-read
	}
	closeFile(stdout)
	close(p.done)
}

// readLines keeps and passes on each stdout line until the pipe ends.
func (p *Process) readLines(stdout io.Reader, onLine func(string), read chan<- struct{}) {
	defer close(read)
	sc := bufio.NewScanner(stdout)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		p.keepOutput([]byte(sc.Text() + "\n"))
		if onLine != nil {
			onLine(sc.Text())
		}
	}
	_, _ = io.Copy(io.Discard, stdout) // a line too long for the scanner
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
	if !p.Exited() {
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
	case <-p.done:
	case <-t.C:
		if !p.Exited() { // both ready: select picks either, and the child is done
			p.Kill()
			return p.failure(fmt.Errorf("%w (%v)", ErrTimedOut, timeout))
		}
	}
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
