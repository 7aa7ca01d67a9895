"""The daemon process (process.py), its control operations (ops, retune, user_ops), sd_notify."""
