"""Test and demo library: real processes, polled with deadlines, torn down as whole trees."""
