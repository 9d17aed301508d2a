"""Routing and proxying in front of tripod servers: the routing policy and its approximate prefix
tree, health and load probing, the proxy with retries, and the failover relay. The router talks to
replicas over HTTP only (never by import); launching them is ``tripod.fleet``'s job."""
