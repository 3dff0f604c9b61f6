"""The assembled product: the server's engine loop, `hetero serve`, `hetero monitor`, `hetero bench`.

Top of the stack (docs/design.md): these modules assemble an engine and drive it; nothing
below imports them.
"""
