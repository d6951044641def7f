"""How a process runs: its device and peers, precision, random generators, run lock, stop signals and console."""
