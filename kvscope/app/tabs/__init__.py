"""The page's tabs, one module each: a ``build`` function makes its components and wires their events."""
