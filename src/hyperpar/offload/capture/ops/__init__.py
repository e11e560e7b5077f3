"""The op facts every path shares: what an op reads and writes, what it is, what it
allocates, the step's storage table."""
