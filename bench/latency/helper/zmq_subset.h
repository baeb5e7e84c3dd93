/*
 * zmq_subset.h - the part of libzmq's C API (4.x, a stable ABI) that
 * tbench.c's ZMQ baseline calls, declared here so that the baseline builds
 * against the libzmq shipped inside pyzmq's wheel (PyPI), on a machine with
 * no libzmq headers (no root, no Debian package). tbench.c includes it in
 * place of <zmq.h> when built with -DTBENCH_ZMQ_SUBSET (bench/latency,
 * TBENCH_LIBZMQ). Values are libzmq's; the bench smoke test runs the
 * baseline through it.
 */
#ifndef TBENCH_ZMQ_SUBSET_H
#define TBENCH_ZMQ_SUBSET_H

#include <stddef.h>

/* socket types */
#define ZMQ_SUB 2
#define ZMQ_XPUB 9
/* socket options */
#define ZMQ_SUBSCRIBE 6
#define ZMQ_SNDHWM 23
#define ZMQ_RCVHWM 24
#define ZMQ_XPUB_VERBOSE 40
#define ZMQ_XPUB_NODROP 69
/* send / receive flags */
#define ZMQ_DONTWAIT 1
#define ZMQ_SNDMORE 2

/* A message: 64 opaque bytes, pointer-aligned, owned by libzmq. */
typedef struct zmq_msg_t {
  unsigned char opaque[64] __attribute__((aligned(sizeof(void *))));
} zmq_msg_t;
typedef void(zmq_free_fn)(void *data, void *hint);

int zmq_errno(void);
const char *zmq_strerror(int errnum);
void *zmq_ctx_new(void);
int zmq_ctx_term(void *context);
void *zmq_socket(void *context, int type);
int zmq_close(void *socket);
int zmq_setsockopt(void *socket, int option, const void *value, size_t len);
int zmq_bind(void *socket, const char *endpoint);
int zmq_connect(void *socket, const char *endpoint);
int zmq_recv(void *socket, void *buf, size_t len, int flags);
int zmq_msg_init(zmq_msg_t *msg);
int zmq_msg_init_size(zmq_msg_t *msg, size_t size);
int zmq_msg_init_data(zmq_msg_t *msg, void *data, size_t size, zmq_free_fn *free_fn, void *hint);
int zmq_msg_send(zmq_msg_t *msg, void *socket, int flags);
int zmq_msg_recv(zmq_msg_t *msg, void *socket, int flags);
int zmq_msg_close(zmq_msg_t *msg);
void *zmq_msg_data(zmq_msg_t *msg);
size_t zmq_msg_size(const zmq_msg_t *msg);

#endif
