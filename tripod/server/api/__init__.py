"""The API surfaces: one module per surface with its routes (``openai``, ``anthropic``, ``admin``,
``lora``, ``pd``, ``openapi``), the request models of the two generating surfaces beside them
(``openai_requests``, ``anthropic_requests``), and what the surfaces share on the way in: request
bodies (``body``), request → ``SamplingParams`` (``sampling``), starting a generation
(``admission``) and the router's failover (``failover``).
"""
