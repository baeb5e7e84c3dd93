/*
 * defaults.h - the producer's option defaults, the one place they are
 * written. Go reads them through cgo (producer/defaults.go: DefaultSlots
 * and the others, which Options.fill applies to a zero field);
 * tsock_producer_options_init (cabi/shim.c) writes them into a C caller's
 * options; Python's Producer takes them from tsock_producer_options_init.
 * include/tsock.h and docs/PYTHON.md state them in prose: change them
 * there too.
 */
#ifndef TSOCK_PRODUCER_DEFAULTS_H
#define TSOCK_PRODUCER_DEFAULTS_H

#define TSOCK_DEFAULT_SLOT_COUNT 16         /* ring depth */
#define TSOCK_DEFAULT_SLOT_BYTES (1u << 20) /* payload bytes per batch: 1 MiB */
#define TSOCK_DEFAULT_MAX_READERS 64        /* reader records */
#define TSOCK_DEFAULT_MODE 0600             /* segment permissions: user only */

#endif
