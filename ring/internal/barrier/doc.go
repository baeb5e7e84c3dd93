// Package barrier holds the memory barrier ring needs on arm64 that Go does
// not offer, in Go assembly (see ring/order_arm64.go). It is a package of
// its own because ring uses cgo, and the go tool hands the .s files of a
// cgo package to the C compiler.
package barrier
