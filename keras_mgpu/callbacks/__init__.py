"""Keras callbacks: learning-rate warmup/scaling and resource monitors."""
