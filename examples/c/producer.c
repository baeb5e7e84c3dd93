/* producer.c - publishes EPOCHS epochs of BATCHES batches, each a float32
 * feature matrix [32, 16] and its int64 labels [32], then closes.
 * Usage: producer NAME [READERS=1] [EPOCHS=2] [BATCHES=100] */
#include <stdio.h>
#include <stdlib.h>

#include "tsock.h"

#define ROWS 32
#define COLS 16

static int fail(const char *call, int rc) {
  fprintf(stderr, "%s: %s (%s)\n", call, tsock_status_str(rc), tsock_last_error());
  return 1;
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s NAME [READERS] [EPOCHS] [BATCHES]\n", argv[0]);
    return 2;
  }
  const char *name = argv[1];
  int readers = argc > 2 ? atoi(argv[2]) : 1;
  int epochs = argc > 3 ? atoi(argv[3]) : 2;
  int batches = argc > 4 ? atoi(argv[4]) : 100;

  tsock_producer_options_t opts;
  tsock_producer_options_init(&opts);
  opts.slot_count = 8;
  opts.slot_bytes = 64 * 1024;
  tsock_producer_t *p;
  int rc = tsock_producer_create(name, &opts, &p);
  if (rc != TSOCK_OK) return fail("tsock_producer_create", rc);

  /* A reader that attaches mid-epoch starts at the next one: wait for all. */
  rc = tsock_producer_wait_readers(p, (uint32_t)readers, 10 * 1000000000LL);
  if (rc != TSOCK_OK) return fail("tsock_producer_wait_readers", rc);

  /* Both tensors live in one payload: features first, labels after them. */
  const int64_t x_shape[2] = {ROWS, COLS}, y_shape[1] = {ROWS};
  const uint64_t x_bytes = ROWS * COLS * sizeof(float), y_bytes = ROWS * sizeof(int64_t);
  tsock_tensor_t t[2];
  tsock_tensor_init(&t[0], TSOCK_DTYPE_FLOAT32, 2, x_shape, 0);
  tsock_tensor_init(&t[1], TSOCK_DTYPE_INT64, 1, y_shape, x_bytes);

  for (int e = 0; e < epochs; e++) {
    for (int b = 0; b < batches; b++) {
      void *buf;
      rc = tsock_producer_reserve(p, x_bytes + y_bytes, -1, &buf); /* waits for slow readers */
      if (rc != TSOCK_OK) return fail("tsock_producer_reserve", rc);
      float *x = buf;
      int64_t *y = (int64_t *)((char *)buf + x_bytes);
      for (int i = 0; i < ROWS; i++) {
        y[i] = (b * ROWS + i) % 10;
        for (int j = 0; j < COLS; j++) x[i * COLS + j] = (float)(e + b) + 0.01f * (float)j;
      }
      rc = tsock_producer_publish(p, t, 2, NULL, 0);
      if (rc != TSOCK_OK) return fail("tsock_producer_publish", rc);
    }
    rc = tsock_producer_end_epoch(p, -1);
    if (rc != TSOCK_OK) return fail("tsock_producer_end_epoch", rc);
  }
  printf("published %d epochs of %d batches\n", epochs, batches);
  rc = tsock_producer_close(p); /* readers drain what is published, then see "closed" */
  return rc == TSOCK_OK ? 0 : fail("tsock_producer_close", rc);
}
