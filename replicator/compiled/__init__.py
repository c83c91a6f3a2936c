"""The compiled program: what its HLO computes, moves and sends, which devices its
collectives join, and the Cloud TPU slices it can be compiled for without one."""
