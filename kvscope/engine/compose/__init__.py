"""The composition layer: compiled skills spliced into contexts with a remedy, the N-skill study, pictures, the
keystone (edits inside spliced skills), the errata agent loop and user-memory placement."""
