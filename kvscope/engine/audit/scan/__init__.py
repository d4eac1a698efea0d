"""Stage 2, the token pass: every request rendered, matched and diffed, fed through the simulated caches
(``traffic_scan``), and the sample of turns a bound on the model pass allows (``sampling``)."""
