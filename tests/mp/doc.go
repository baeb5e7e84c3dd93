// Package mp holds tsock's multi-process tests: a Go producer (in the test
// process or in a child) feeding C readers (tests/c/check_reader.c, built by
// the tests) and Go readers (the test binary re-executed as a helper), with
// readers and producers killed mid-stream. All of it is in mp_test.go; this
// file only names the package.
package mp
