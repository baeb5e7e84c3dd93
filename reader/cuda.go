package reader

// cuda_driver.c loads the CUDA driver at run time with dlopen (in libc since
// glibc 2.34, in libdl before). Nothing links CUDA itself.

/*
#cgo LDFLAGS: -ldl
*/
import "C"
