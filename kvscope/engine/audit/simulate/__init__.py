"""Stage 2b, the simulated prefix caches: one interface (``prefix_cache``) filled by the serving engines (``caches``,
``radix``) and hosted providers (``hosted``), named in one registry (``registry``), run as fleets of replicas
(``fleet``), fed a request at a time by one step (``step``), and what servers reported set beside them (``observed``,
``metrics``)."""
