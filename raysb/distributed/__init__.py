"""The Ray layer: the driver (launch), the Ray Train worker loop, the shared loss
history actor and fault drills.
"""
