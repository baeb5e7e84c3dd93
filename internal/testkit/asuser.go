package testkit

import (
	"io"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
)

// Nobody is the uid and gid of the unprivileged user the permission tests
// run children as.
const Nobody = 65534

// NeedRoot skips the test, saying why, unless it runs as root (needed to
// start a child under another uid).
func NeedRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skipf("needs root to run a child process as another user (euid %d)", os.Geteuid())
	}
}

// ExecutableForOthers copies the running test binary into a directory
// every user may read and enter (go test builds it in a private one), so a
// child can run it under another uid. The copy is removed at the end.
func ExecutableForOthers(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "tsock-asuser-")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	require.NoError(t, os.Chmod(dir, 0o755))
	src, err := os.Open(os.Args[0])
	require.NoError(t, err)
	defer src.Close()
	exe := filepath.Join(dir, filepath.Base(os.Args[0]))
	dst, err := os.OpenFile(exe, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o755)
	require.NoError(t, err)
	_, err = io.Copy(dst, src)
	require.NoError(t, err)
	require.NoError(t, dst.Close())
	return exe
}

// AsUser runs a child as uid and gid with the given supplementary groups
// (none when empty), dying with its parent.
func AsUser(uid, gid uint32, groups ...uint32) *syscall.SysProcAttr {
	if groups == nil {
		groups = []uint32{}
	}
	return &syscall.SysProcAttr{
		Credential: &syscall.Credential{Uid: uid, Gid: gid, Groups: groups},
		Pdeathsig:  syscall.SIGKILL,
	}
}
