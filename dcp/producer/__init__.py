"""The DCP producer: engine (vbuckets, checkpoints, failover logs, LMDB) and the trio server."""
