"""The CPU fast path: float32 (and frozen 4-bit) linear layers through oneDNN (:mod:`.linear`), the few-row
decoding kernel in C (:mod:`.rowdot`, ``rowdot.c``) and the lean decoding step's products on it or on prepacked
weights (:mod:`.decode`), freed memory kept for the next step (:mod:`.host_memory`),
weights out of mapped files and on cache lines (:mod:`.weights`) and bitsandbytes' 4-bit layout as these read it
(:mod:`.four_bit`). Where a feature is missing (oneDNN, AVX-512, a C compiler, glibc) each says why and the generic
path runs. The module reaches all of it through :class:`.fast_path.CPUFastPath`. Nothing is imported here: the
rooms import each other, and a package that imported them back would close a circle."""
