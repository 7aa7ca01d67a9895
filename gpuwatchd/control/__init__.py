"""The control socket's wire format, shared by the daemon, the command line and jobs."""
