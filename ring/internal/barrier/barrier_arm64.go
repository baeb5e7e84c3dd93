package barrier

// StoreStore is DMB ISHST: every store before it becomes visible, to every
// observer in the inner shareable domain, before any store after it.
func StoreStore()
