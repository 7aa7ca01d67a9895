"""The daemon process (process.py), its control socket (control_server, ops, retune), sd_notify."""
