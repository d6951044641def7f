"""How a process runs: its device and peers, batches copied to the device, precision, random generators, run lock,
stop signals and console."""
