"""The fleet: a router in front of N tripod servers, a supervisor that launches and restarts them,
an autoscaler, and a Ray backend. The router talks to replicas over HTTP only (never by import)."""
