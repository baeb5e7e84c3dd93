package ring

import (
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// The producer stamps batches with MonotonicNs and C readers compare with
// clock_gettime(CLOCK_MONOTONIC): both must be the same clock.
func TestMonotonicNsIsClockMonotonic(t *testing.T) {
	var ts unix.Timespec
	before := MonotonicNs()
	require.NoError(t, unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts))
	after := MonotonicNs()
	sys := uint64(ts.Sec)*1e9 + uint64(ts.Nsec)
	require.LessOrEqual(t, before, sys)
	require.LessOrEqual(t, sys, after)
}
