/*
 * What fencegate.enforce() and fencegate.guard(text) in C share: the schema's relations looked up
 * by schema and name, HMAC-SHA256 from stored pads, the pass's MAC, and the fence lock.
 */
#ifndef FENCE_STORE_H
#define FENCE_STORE_H

#include "postgres.h"

#include "access/transam.h"
#include "common/sha2.h"
#include "nodes/lockoptions.h"
#include "utils/relcache.h"
#include "utils/snapshot.h"

#define MAC_HEX_LEN (2 * PG_SHA256_DIGEST_LENGTH)
/* `:` + the hex MAC at the end of a pass */
#define PASS_TAIL_LEN (MAC_HEX_LEN + 1)

#define ERRCODE_FG_STALE MAKE_SQLSTATE('F', 'G', '0', '0', '1')
#define ERRCODE_FG_NO_PASS MAKE_SQLSTATE('F', 'G', '0', '0', '2')
#define ERRCODE_FG_MALFORMED MAKE_SQLSTATE('F', 'G', '0', '0', '3')
#define ERRCODE_FG_FORGED MAKE_SQLSTATE('F', 'G', '0', '0', '4')
#define ERRCODE_FG_RESOURCE MAKE_SQLSTATE('F', 'G', '0', '0', '5')

/*
 * The digest states after one key's two pads, kept while the pads read stay the same. One per
 * key a function uses, so that two keys in one call do not evict each other.
 */
typedef struct PadCache
{
	void	   *after_ipad;		/* EVP_MD_CTX * */
	void	   *after_opad;		/* EVP_MD_CTX * */
	char	   *pads;			/* ipad || opad, in TopMemoryContext; NULL: no valid state */
	size_t		ipad_len;
	size_t		opad_len;
} PadCache;

/* The OID of table fencegate.<name>, looked up by schema and name (no search_path). */
extern Oid	fencegate_relid(const char *name);

/* The attribute number of column `name` of `rel`; an error if it has none. */
extern AttrNumber fencegate_column(Relation rel, const char *name);

/* HMAC-SHA256 over m1 || m2 from the key's stored pads (`cache` keeps their digest states). */
extern void fencegate_hmac(PadCache *cache, const bytea *ipad, const bytea *opad,
						   const uint8 *m1, size_t m1len, const uint8 *m2, size_t m2len,
						   uint8 *out);

/*
 * The pass's MAC: HMAC-SHA256 with the pass key (fencegate.pass_key, read under `snap`) over
 * `pass2:<pid>:<txid>:` || held, held being `revision:resource` (see fencegate.set_pass).
 */
extern void fencegate_pass_mac(const char *held, size_t held_len, FullTransactionId fxid,
							   Snapshot snap, uint8 *out);

/*
 * Records `pass` as verified in top transaction `fxid` (fencegate_enforce.c): enforce() then skips
 * the pass key read and the MAC for it. Only for a pass whose MAC was computed or checked here.
 */
extern void fencegate_remember_pass(const char *pass, FullTransactionId fxid);

/*
 * The fence lock (fence_lock.c): takes `resource`'s fence lock in ShareLock and reads the fence
 * under a snapshot taken after it. True if the fence stands at `revision` (the lock is kept to
 * the end of the transaction). Else false, with the fence's revision in *fence ("" without a row
 * or when skipped). `wait`: LockWaitBlock waits for a writer of the fence row, LockWaitSkip
 * gives up at once.
 */
extern bool fencegate_share_fence(const char *resource, int64 revision, LockWaitPolicy wait,
								  char **fence);

#endif							/* FENCE_STORE_H */
