"""The fleet: launching, supervising and scaling tripod servers behind a router.

``process`` starts one ``tripod serve`` child (and waits for it to be healthy), ``replicas`` and
``ray_backend`` launch replicas locally or as Ray actors, ``supervisor`` restarts them and applies
the ``autoscaler``'s decisions, ``launch`` runs ``tripod route`` / ``tripod serve --replicas``, and
``multi`` puts the fleets of several models behind one router. The fleet sits above ``router``:
it imports the router, never the reverse.
"""
