"""Server subprocess plumbing shared by every server and its launcher: managed processes
(start, health, stop by PID), process identity and trees (psutil), port binding, parent watch."""
