/* cuda_shim.c - compiles the reader's CUDA files (cuda/driver.c, host.c,
 * device.c) into package reader, hence into libtsock.so: cgo builds only
 * the .c files of a package's own folder. (CMake and setup.py compile them
 * directly into libtsock_reader.so.) */
#include "../cuda/driver.c"
#include "../cuda/host.c"
#include "../cuda/device.c"
