package main

// Children forked without exec by the soak's C and Python readers and by
// its C producer (each prints "forked pid=P"): they sleep --fork-life and
// exit, holding their parent's mapping of the segment, as DataLoader
// workers and trainers' helpers do. The soak follows each through a pidfd,
// opened while the child cannot have been reaped yet (its parent never
// waits for it), so a reused pid is never mistaken for it; it makes itself
// a child subreaper, so that the children of a killed parent become its
// own and it reaps them, and kills whatever is left at the end.

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// forked is one child forked by a reader or a producer of the soak.
type forked struct {
	pid    int
	pidfd  int
	parent *child
}

// onForked starts following a child that c forked (output goroutine, s.mu
// held).
func (s *soak) onForked(c *child, pid int) {
	fd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		s.failures = append(s.failures, fmt.Sprintf("%s forked pid %d, which cannot be followed: %v",
			c.label(), pid, err))
		return
	}
	s.forks = append(s.forks, &forked{pid: pid, pidfd: fd, parent: c})
	c.forks++
}

// alive tells whether f has not exited yet (a pidfd is readable once its
// process has exited, zombie or reaped).
func (f *forked) alive() bool {
	pfd := []unix.PollFd{{Fd: int32(f.pidfd), Events: unix.POLLIN}}
	for {
		n, err := unix.Poll(pfd, 0)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		return err == nil && n == 0
	}
}

// liveForks are the children c forked that are alive now.
func (s *soak) liveForks(c *child) []*forked {
	s.mu.Lock()
	defer s.mu.Unlock()
	var live []*forked
	for _, f := range s.forks {
		if f.parent == c && f.alive() {
			live = append(live, f)
		}
	}
	return live
}

// liveForksCount is how many followed children are alive now.
func (s *soak) liveForksCount() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, f := range s.forks {
		if f.alive() {
			n++
		}
	}
	return n
}

// anyAlive tells whether one of fs is still alive.
func anyAlive(fs []*forked) bool {
	for _, f := range fs {
		if f.alive() {
			return true
		}
	}
	return false
}

// reapForks reaps the children that exited after their parent died (they
// are the soak's own then) and stops following them.
func (s *soak) reapForks() {
	s.mu.Lock()
	defer s.mu.Unlock()
	keep := s.forks[:0]
	for _, f := range s.forks {
		if f.alive() || !reap(f) {
			keep = append(keep, f)
			continue
		}
		unix.Close(f.pidfd)
	}
	clear(s.forks[len(keep):])
	s.forks = keep
}

// reap waits for f, which has exited, and tells whether it was reaped:
// not while it is still its parent's child (ECHILD).
func reap(f *forked) bool {
	for {
		var info unix.Siginfo
		err := unix.Waitid(unix.P_PIDFD, f.pidfd, &info, unix.WEXITED|unix.WNOHANG, nil)
		if !errors.Is(err, unix.EINTR) {
			return err == nil
		}
	}
}

// reapBlocking waits for f to exit and reaps it (it must be our child).
func reapBlocking(f *forked) {
	for {
		var info unix.Siginfo
		if err := unix.Waitid(unix.P_PIDFD, f.pidfd, &info, unix.WEXITED, nil); !errors.Is(err, unix.EINTR) {
			return
		}
	}
}

// killForks kills and reaps every child still followed (at the end, when
// their parents are gone), then any other child of the soak that is not
// one of its own processes: one whose "forked" line was lost with its
// parent.
func (s *soak) killForks(own map[int]bool) {
	s.mu.Lock()
	fs := s.forks
	s.forks = nil
	s.mu.Unlock()
	for _, f := range fs {
		if f.alive() {
			_ = unix.PidfdSendSignal(f.pidfd, unix.SIGKILL, nil, 0)
		}
		reapBlocking(f)
		unix.Close(f.pidfd)
	}
	for _, pid := range childrenOf(os.Getpid()) {
		if own[pid] {
			continue
		}
		// A child of ours that we have not reaped: its pid cannot be reused.
		_ = unix.Kill(pid, unix.SIGKILL)
		var ws unix.WaitStatus
		_, _ = unix.Wait4(pid, &ws, 0, nil)
	}
}

// childrenOf lists the processes whose parent is pid (/proc/*/stat).
func childrenOf(pid int) []int {
	ents, _ := os.ReadDir("/proc")
	var kids []int
	for _, e := range ents {
		p, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		// pid (comm) state ppid ...: comm may hold spaces and parentheses.
		st := string(b)
		f := strings.Fields(st[strings.LastIndexByte(st, ')')+1:])
		if len(f) > 1 && f[1] == strconv.Itoa(pid) {
			kids = append(kids, p)
		}
	}
	return kids
}

// setSubreaper makes this process the reaper of its orphaned descendants
// (on) or not (off).
func setSubreaper(on bool) error {
	v := 0
	if on {
		v = 1
	}
	return unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, uintptr(v), 0, 0, 0)
}

// monoNow is CLOCK_MONOTONIC, the clock the readers stamp "gone" with.
func monoNow() time.Duration {
	var ts unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return time.Duration(ts.Nano())
}
