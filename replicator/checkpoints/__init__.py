"""Checkpoints on Orbax: saves, exact resumes, restores onto any devices, and a
checkpoint directory's files checked and named."""
