/* cuda_shim.c - compiles cuda/driver.c and cuda/host.c into package reader,
 * hence into libtsock.so: cgo builds only the .c files of a package's own
 * folder. (CMake and setup.py compile cuda/driver.c and host.c directly into
 * libtsock_reader.so.) */
#include "../cuda/driver.c"
#include "../cuda/host.c"
