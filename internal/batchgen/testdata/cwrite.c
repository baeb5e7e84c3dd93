/*
 * cwrite.c - prints what batchgen_write (batchgen.h) writes for each batch
 * counter given, for TestCWriterMatchesGo: one line per batch,
 *   i=<i> t0=<dtype>,<ndim>,<shape>,<stride>,<offset>,<nbytes> t1=... meta=<hex> payload=<hex>
 */
#include <stdio.h>
#include <stdlib.h>

#include "../batchgen.h"

static void hex(const uint8_t *p, uint64_t n) {
  for (uint64_t k = 0; k < n; k++) printf("%02x", p[k]);
}

int main(int argc, char **argv) {
  static uint8_t payload[BATCHGEN_MAX_LEN + 64];
  for (int a = 1; a < argc; a++) {
    uint64_t i = strtoull(argv[a], NULL, 10);
    tsock_tensor_t t[2];
    uint8_t meta[8];
    for (size_t k = 0; k < sizeof payload; k++) payload[k] = 0xee;
    batchgen_write(payload, i, t, meta);
    printf("i=%llu", (unsigned long long)i);
    for (int k = 0; k < 2; k++)
      printf(" t%d=%d,%d,%lld,%lld,%llu,%llu", k, t[k].dtype, t[k].ndim, (long long)t[k].shape[0],
             (long long)t[k].strides[0], (unsigned long long)t[k].offset, (unsigned long long)t[k].nbytes);
    printf(" meta=");
    hex(meta, sizeof meta);
    printf(" payload=");
    hex(payload, batchgen_payload_bytes(i));
    printf("\n");
  }
  return 0;
}
