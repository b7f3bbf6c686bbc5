"""`play`: a playbook's steps, each the library function of its command, in order per target."""
