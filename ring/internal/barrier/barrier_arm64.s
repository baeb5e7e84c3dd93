#include "textflag.h"

// func StoreStore()
TEXT ·StoreStore(SB), NOSPLIT|NOFRAME, $0-0
	DMB	$0xe // ISHST
	RET
