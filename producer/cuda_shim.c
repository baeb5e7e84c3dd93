/* cuda_shim.c - compiles cuda/pool.c (the device pool) into package
 * producer: cgo builds only the .c files of a package's own folder. */
#include "../cuda/pool.c"
