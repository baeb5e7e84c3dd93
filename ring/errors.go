package ring

import (
	"errors"
	"fmt"
)

// Status is a tsock status code (tsock.h); as an error it reads as the
// status string.
type Status int

func (s Status) Error() string { return statusString(int(s)) }

// Error is a failed tsock operation: a status and a detailed message.
// errors.Is(err, StatusBackpressure) and the like match on the status.
type Error struct {
	Status Status
	Detail string
}

func (e *Error) Error() string { return e.Detail }

// Is makes errors.Is match an Error against its Status.
func (e *Error) Is(target error) bool {
	t, ok := target.(Status)
	return ok && t == e.Status
}

// Errorf builds an Error with a formatted detail message.
func Errorf(st int, format string, args ...any) error {
	return &Error{Status: Status(st), Detail: fmt.Sprintf(format, args...)}
}

// StatusOf is the status of err: StatusOK for nil, the status of the first
// Error or Status in its chain (fmt.Errorf's %w keeps it), StatusSys for
// anything else.
func StatusOf(err error) int {
	if err == nil {
		return StatusOK
	}
	var e *Error
	if errors.As(err, &e) {
		return int(e.Status)
	}
	var s Status
	if errors.As(err, &s) {
		return int(s)
	}
	return StatusSys
}
