"""ketch's own C kernels for the CPU path, compiled once per machine (build.py) and called through
ctypes: the 4-bit weight product of decode-sized steps (q4.py, q4_matmul.c)."""
