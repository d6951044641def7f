"""How a process runs: device and peers, device batches, precision, generators, run lock, stop signals, console."""
