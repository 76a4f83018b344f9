"""Helpers every entry point shares: one-line usage errors, the CPU allocator setting."""
