"""`ketch gateway`: an HTTP router in front of several `ketch serve` workers (see README.md)."""
