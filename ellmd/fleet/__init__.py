"""A fleet of ellm replicas on Ray Serve (the optional extra `ellm[ray]`): app.py is the Serve
application, replica.py a replica around its daemon, routing.py the session affinity key. Nothing
else in ellmd imports this package."""
