package producer

// Test hooks (compiled into this package's tests only).

// SetShmDirForTest makes channels in dir instead of /dev/shm and returns
// the function that puts it back.
func SetShmDirForTest(dir string) (restore func()) {
	old := shmDir
	shmDir = dir
	return func() { shmDir = old }
}

// SkipFreeCheckForTest turns off the early statfs check, so that a segment
// too big meets fallocate's ENOSPC.
func SkipFreeCheckForTest() (restore func()) {
	checkFree = false
	return func() { checkFree = true }
}

// NoTmpfileForTest makes Create take the fallback of a system without
// O_TMPFILE: a hidden temporary name.
func NoTmpfileForTest() (restore func()) {
	useTmpfile = false
	return func() { useTmpfile = true }
}

// SetStaleLockedHookForTest runs hook each time Create has found a dead
// segment's producer lock held (a reclaimer's moment on the lock, or a
// live producer), before it decides to look again or give up, and returns
// the function that removes it.
func SetStaleLockedHookForTest(hook func()) (restore func()) {
	staleLockedHook = hook
	return func() { staleLockedHook = nil }
}
