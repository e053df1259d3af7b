/*
 * fencegate_enforce: fencegate.enforce() in C, an optional accelerator for the plpgsql trigger
 * function in filters/postgres/src/fence.sql (issue 12: the plpgsql version costs about a third
 * of a pgbench write transaction; most of that is plpgsql's own per-call set-up).
 *
 * The contract is the plpgsql version's, check for check, SQLSTATE for SQLSTATE:
 *   no fencegate.pass                          -> FG002 ("needs a fencing token")
 *   pass whose MAC does not verify             -> FG002 ("not made by fencegate.guard")
 *   table bound to another resource            -> FG005
 *   no fence row at the pass's revision        -> FG001 (with DETAIL)
 * The pass is `revision:resource:mac`, mac = hex HMAC-SHA256 with the pass key's stored pads
 * over `pass2:pid:txid:revision:resource` (see fencegate.set_pass). The fence row is taken
 * FOR SHARE on every statement: a savepoint rolled back releases the guard's lock while the
 * client can put the pass string back.
 *
 * It reads the pass key and takes the fence row through the table and index access methods, not
 * SPI: an SPI query costs about 33k instructions per call in executor set-up alone, the whole
 * budget of the 5 % target (docs/BENCHMARKS.md). The lock is taken as SELECT ... FOR SHARE's
 * executor node takes it: same snapshot (a new one per statement in READ COMMITTED, as SPI takes),
 * same wait, the update chain followed to the latest version in READ COMMITTED and a
 * serialization failure in REPEATABLE READ and SERIALIZABLE.
 *
 * It runs SECURITY DEFINER as the schema's owner inside the server: it looks up its relations by
 * schema and name (`fencegate`), never through the caller's search_path or pg_temp, and calls no
 * operator or function the caller could define; the client-set pass is only read within its
 * length; the MAC is compared in constant time. It checks no table privileges: it only reads
 * and share-locks rows of its owner's own tables, and a check could only make it refuse more.
 */
#include "postgres.h"

#include "access/genam.h"
#include "access/skey.h"
#include "access/stratnum.h"
#include "access/table.h"
#include "access/tableam.h"
#include "access/transam.h"
#include "access/xact.h"
#include "catalog/namespace.h"
#include "catalog/pg_type.h"
#include "commands/trigger.h"
#include "executor/tuptable.h"
#include "common/cryptohash.h"
#include "common/sha2.h"
#include "fmgr.h"
#include "mb/pg_wchar.h"
#include "miscadmin.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/lsyscache.h"
#include "utils/fmgroids.h"
#include "utils/memutils.h"
#include "utils/rel.h"
#include "utils/snapmgr.h"

#include <openssl/evp.h>

PG_MODULE_MAGIC;

PG_FUNCTION_INFO_V1(fencegate_enforce);

#define MAC_HEX_LEN (2 * PG_SHA256_DIGEST_LENGTH)
/* `:` + the hex MAC at the end of a pass */
#define PASS_TAIL_LEN (MAC_HEX_LEN + 1)

#define ERRCODE_FG_STALE MAKE_SQLSTATE('F', 'G', '0', '0', '1')
#define ERRCODE_FG_NO_PASS MAKE_SQLSTATE('F', 'G', '0', '0', '2')
#define ERRCODE_FG_RESOURCE MAKE_SQLSTATE('F', 'G', '0', '0', '5')

#define PASS_HINT \
	"Call SELECT fencegate.guard('<token>') first in the same transaction (the gateway does it for you). " \
	"A procedure that COMMITs ends the guarded transaction."

/*
 * The last pass whose MAC verified, and the top transaction it verified in: later statements of
 * the same transaction with the same pass text skip the key read and the MAC (the MAC binds the
 * pass to this backend and transaction, so the result cannot differ). Never the fence lock.
 * A pass verified once stays verified until its transaction ends, even if the pass key is
 * replaced meanwhile (only `fencegate postgres install` writes it); the plpgsql version would
 * refuse it at the next statement.
 */
static FullTransactionId verified_fxid;
static char *verified_pass = NULL;	/* in TopMemoryContext */
static size_t verified_len = 0;

/* The OID of fencegate.<name>, looked up by schema and name (no search_path). */
static Oid
fencegate_relid(const char *name)
{
	Oid			relid = get_relname_relid(name, get_namespace_oid("fencegate", false));

	if (!OidIsValid(relid))
		ereport(ERROR,
				(errcode(ERRCODE_UNDEFINED_TABLE),
				 errmsg("fencegate.enforce: table fencegate.%s does not exist", name),
				 errhint("Run `fencegate postgres install` again.")));
	return relid;
}

/* The attribute number of column `name` of `rel`; an error if it has none. */
static AttrNumber
column(Relation rel, const char *name)
{
	TupleDesc	desc = RelationGetDescr(rel);
	int			i;

	for (i = 0; i < desc->natts; i++)
	{
		Form_pg_attribute att = TupleDescAttr(desc, i);

		if (!att->attisdropped && strcmp(NameStr(att->attname), name) == 0)
			return att->attnum;
	}
	ereport(ERROR,
			(errcode(ERRCODE_UNDEFINED_COLUMN),
			 errmsg("fencegate.enforce: column %s of fencegate.%s does not exist",
					name, RelationGetRelationName(rel)),
			 errhint("Run `fencegate postgres install` again.")));
	return InvalidAttrNumber;	/* not reached */
}

/*
 * HMAC-SHA256 from the key's stored pads with OpenSSL's EVP directly: the algorithm fetched and
 * the contexts made once per backend, and the digest states after each pad (one block each) kept
 * for as long as the pads read are the same. Through pg_cryptohash (a context per hash, OpenSSL 3
 * fetching the algorithm on every init) the MAC cost about 18k instructions, half this
 * function's budget.
 */
static void
hmac_from_pads(const bytea *ipad, const bytea *opad, const uint8 *m1, size_t m1len,
			   const uint8 *m2, size_t m2len, uint8 *out)
{
	static const EVP_MD *md = NULL;
	static EVP_MD_CTX *ctx = NULL;
	static EVP_MD_CTX *after_ipad = NULL;
	static EVP_MD_CTX *after_opad = NULL;
	/* The pads the two states above absorbed (ipad || opad), in TopMemoryContext. */
	static char *pads = NULL;
	static size_t ipad_len = 0;
	static size_t opad_len = 0;
	size_t		ilen = VARSIZE(ipad) - VARHDRSZ;
	size_t		olen = VARSIZE(opad) - VARHDRSZ;
	uint8		inner[PG_SHA256_DIGEST_LENGTH];
	unsigned int out_len = 0;

	if (md == NULL)
#if OPENSSL_VERSION_NUMBER >= 0x30000000L
		md = EVP_MD_fetch(NULL, "SHA256", NULL);
#else
		md = EVP_sha256();
#endif
	if (ctx == NULL)
		ctx = EVP_MD_CTX_new();
	if (after_ipad == NULL)
		after_ipad = EVP_MD_CTX_new();
	if (after_opad == NULL)
		after_opad = EVP_MD_CTX_new();
	if (md == NULL || ctx == NULL || after_ipad == NULL || after_opad == NULL)
		ereport(ERROR, (errcode(ERRCODE_OUT_OF_MEMORY),
						errmsg("fencegate.enforce: OpenSSL has no SHA-256 context")));
	if (pads == NULL || ipad_len != ilen || opad_len != olen
		|| memcmp(pads, VARDATA(ipad), ilen) != 0
		|| memcmp(pads + ilen, VARDATA(opad), olen) != 0)
	{
		char	   *both = MemoryContextAlloc(TopMemoryContext, ilen + olen + 1);

		/* Forget the old states first: an error below leaves none marked valid. */
		if (pads != NULL)
			pfree(pads);
		pads = NULL;
		if (EVP_DigestInit_ex(after_ipad, md, NULL) != 1
			|| EVP_DigestUpdate(after_ipad, VARDATA(ipad), ilen) != 1
			|| EVP_DigestInit_ex(after_opad, md, NULL) != 1
			|| EVP_DigestUpdate(after_opad, VARDATA(opad), olen) != 1)
			elog(ERROR, "fencegate.enforce: could not compute SHA-256");
		memcpy(both, VARDATA(ipad), ilen);
		memcpy(both + ilen, VARDATA(opad), olen);
		pads = both;
		ipad_len = ilen;
		opad_len = olen;
	}
	if (EVP_MD_CTX_copy_ex(ctx, after_ipad) != 1
		|| EVP_DigestUpdate(ctx, m1, m1len) != 1
		|| EVP_DigestUpdate(ctx, m2, m2len) != 1
		|| EVP_DigestFinal_ex(ctx, inner, &out_len) != 1
		|| out_len != PG_SHA256_DIGEST_LENGTH
		|| EVP_MD_CTX_copy_ex(ctx, after_opad) != 1
		|| EVP_DigestUpdate(ctx, inner, sizeof(inner)) != 1
		|| EVP_DigestFinal_ex(ctx, out, &out_len) != 1
		|| out_len != PG_SHA256_DIGEST_LENGTH)
		elog(ERROR, "fencegate.enforce: could not compute SHA-256");
}

/*
 * Whether the last MAC_HEX_LEN bytes of the pass are the MAC of `held` (the pass without its
 * `:mac` tail) in this backend's current top transaction, with the pass key read under `snap`.
 */
static bool
mac_verifies(const char *pass, size_t len, FullTransactionId fxid, Snapshot snap)
{
	static const char hex[] = "0123456789abcdef";
	size_t		held_len = len - PASS_TAIL_LEN;
	const char *given = pass + len - MAC_HEX_LEN;
	char		prefix[64];
	int			prefix_len;
	char	   *held_utf8;
	Relation	rel;
	TupleTableSlot *slot;
	TableScanDesc scan;
	AttrNumber	ipad_att;
	AttrNumber	opad_att;
	Datum		ipad_datum;
	Datum		opad_datum;
	bytea	   *ipad;
	bytea	   *opad;
	bool		isnull_i;
	bool		isnull_o;
	uint8		outer[PG_SHA256_DIGEST_LENGTH];
	volatile uint8 diff = 0;
	int			i;

	rel = table_open(fencegate_relid("pass_key"), AccessShareLock);
	ipad_att = column(rel, "ipad");
	opad_att = column(rel, "opad");
	slot = table_slot_create(rel, NULL);
	scan = table_beginscan(rel, snap, 0, NULL);
	if (!table_scan_getnextslot(scan, ForwardScanDirection, slot))
		ereport(ERROR,
				(errcode(ERRCODE_NO_DATA_FOUND),
				 errmsg("fencegate.enforce: fencegate.pass_key is empty"),
				 errhint("Run `fencegate postgres install` again.")));
	ipad_datum = slot_getattr(slot, ipad_att, &isnull_i);
	opad_datum = slot_getattr(slot, opad_att, &isnull_o);
	if (isnull_i || isnull_o)
		elog(ERROR, "fencegate.enforce: fencegate.pass_key has a NULL pad");
	/* Copies (detoasted), so the scan can end before hashing. */
	ipad = DatumGetByteaPCopy(ipad_datum);
	opad = DatumGetByteaPCopy(opad_datum);
	table_endscan(scan);
	ExecDropSingleTupleTableSlot(slot);
	table_close(rel, NoLock);

	prefix_len = snprintf(prefix, sizeof(prefix), "pass2:%d:%llu:", MyProcPid,
						  (unsigned long long) U64FromFullTransactionId(fxid));
	/* As the plpgsql version: convert_to(message, 'UTF8'); no copy when the server is UTF8. */
	held_utf8 = pg_server_to_any(pass, (int) held_len, PG_UTF8);
	if (held_utf8 != pass)
		held_len = strlen(held_utf8);

	hmac_from_pads(ipad, opad, (const uint8 *) prefix, prefix_len,
				   (const uint8 *) held_utf8, held_len, outer);

	for (i = 0; i < PG_SHA256_DIGEST_LENGTH; i++)
	{
		diff |= (uint8) given[2 * i] ^ (uint8) hex[outer[i] >> 4];
		diff |= (uint8) given[2 * i + 1] ^ (uint8) hex[outer[i] & 0x0f];
	}
	return diff == 0;
}

/*
 * Takes the fence row of `resource` FOR SHARE if it stands at `revision`: true if locked. Else
 * false, with the fence's revision (as text, "" without a row) in *fence for the message.
 */
static bool
lock_fence(const char *resource, int64 revision, Snapshot snap, char **fence)
{
	Relation	rel;
	Relation	idx;
	Oid			pkey;
	AttrNumber	resource_att;
	AttrNumber	revision_att;
	TupleTableSlot *slot;
	IndexScanDesc scan;
	ScanKeyData key;
	ItemPointerData tid;
	TM_FailureData tmfd;
	TM_Result	result;
	bool		seen;
	bool		locked = false;
	bool		isnull;
	Datum		value;

	*fence = "";
	rel = table_open(fencegate_relid("fences"), RowShareLock);
	resource_att = column(rel, "resource");
	revision_att = column(rel, "revision");
	pkey = RelationGetPrimaryKeyIndex(rel);
	if (!OidIsValid(pkey))
		elog(ERROR, "fencegate.enforce: fencegate.fences has no primary key; run `fencegate postgres install` again");
	idx = index_open(pkey, RowShareLock);
	if (idx->rd_index->indnatts != 1 || idx->rd_index->indkey.values[0] != resource_att)
		elog(ERROR, "fencegate.enforce: the primary key of fencegate.fences is not (resource); run `fencegate postgres install` again");

	/* resource = $1 with the index's own collation, so the search follows the index's order. */
	ScanKeyEntryInitialize(&key, 0, 1, BTEqualStrategyNumber, InvalidOid,
						   idx->rd_indcollation[0], F_TEXTEQ, CStringGetTextDatum(resource));
	slot = table_slot_create(rel, NULL);
	scan = index_beginscan(rel, idx, snap, 1, 0);
	index_rescan(scan, &key, 1, NULL, 0);
	seen = index_getnext_slot(scan, ForwardScanDirection, slot);
	if (seen)
		tid = slot->tts_tid;
	index_endscan(scan);

	if (seen)
	{
		value = slot_getattr(slot, revision_att, &isnull);
		if (!isnull && DatumGetInt64(value) == revision)
		{
			/* As SELECT ... FOR SHARE does (nodeLockRows.c). */
			result = table_tuple_lock(rel, &tid, snap, slot, GetCurrentCommandId(true),
									  LockTupleShare, LockWaitBlock,
									  TUPLE_LOCK_FLAG_LOCK_UPDATE_IN_PROGRESS |
									  (IsolationUsesXactSnapshot() ? 0 : TUPLE_LOCK_FLAG_FIND_LAST_VERSION),
									  &tmfd);
			switch (result)
			{
				case TM_Ok:
					/* Followed to a newer version (READ COMMITTED): check it again. */
					locked = true;
					if (tmfd.traversed)
					{
						text	   *now = DatumGetTextPP(slot_getattr(slot, resource_att, &isnull));

						value = slot_getattr(slot, revision_att, &isnull);
						locked = !isnull && DatumGetInt64(value) == revision
							&& strcmp(text_to_cstring(now), resource) == 0;
					}
					break;
				case TM_SelfModified:
					/* Changed by this transaction's own later command: not a match. */
					break;
				case TM_Updated:
				case TM_Deleted:
					if (IsolationUsesXactSnapshot())
						ereport(ERROR,
								(errcode(ERRCODE_T_R_SERIALIZATION_FAILURE),
								 errmsg("could not serialize access due to concurrent update")));
					/* READ COMMITTED: deleted (an update was followed). */
					if (result == TM_Updated)
						elog(ERROR, "fencegate.enforce: unexpected table_tuple_lock status %d", (int) result);
					break;
				case TM_Invisible:
					elog(ERROR, "fencegate.enforce: attempted to lock invisible tuple");
					break;
				default:
					elog(ERROR, "fencegate.enforce: unexpected table_tuple_lock status %d", (int) result);
					break;
			}
			if (!locked && !TTS_EMPTY(slot))
				value = slot_getattr(slot, revision_att, &isnull);
		}
		if (!locked && !TTS_EMPTY(slot) && !isnull)
			*fence = psprintf(INT64_FORMAT, DatumGetInt64(value));
	}
	ExecDropSingleTupleTableSlot(slot);
	index_close(idx, NoLock);
	table_close(rel, NoLock);
	return locked;
}

static const char *
trigger_op(TriggerData *trigdata)
{
	TriggerEvent ev = trigdata->tg_event;

	if (TRIGGER_FIRED_BY_INSERT(ev))
		return "INSERT";
	if (TRIGGER_FIRED_BY_UPDATE(ev))
		return "UPDATE";
	if (TRIGGER_FIRED_BY_DELETE(ev))
		return "DELETE";
	if (TRIGGER_FIRED_BY_TRUNCATE(ev))
		return "TRUNCATE";
	return "UNKNOWN";
}

#define REL_SCHEMA(rel) quote_identifier(get_namespace_name(RelationGetNamespace(rel)))
#define REL_NAME(rel) quote_identifier(RelationGetRelationName(rel))

Datum
fencegate_enforce(PG_FUNCTION_ARGS)
{
	TriggerData *trigdata;
	Relation	rel;
	const char *bound = NULL;
	const char *setting;
	char	   *pass;
	size_t		len;
	size_t		held_len;
	char	   *held;
	char	   *colon;
	char	   *revision_text;
	char	   *resource;
	char	   *fence;
	FullTransactionId fxid;
	Snapshot	snap;
	bool		locked;

	if (!CALLED_AS_TRIGGER(fcinfo))
		ereport(ERROR,
				(errcode(ERRCODE_E_R_I_E_TRIGGER_PROTOCOL_VIOLATED),
				 errmsg("fencegate.enforce() can only be called as a trigger")));
	trigdata = (TriggerData *) fcinfo->context;
	rel = trigdata->tg_relation;
	if (trigdata->tg_trigger->tgnargs > 0)
		bound = trigdata->tg_trigger->tgargs[0];

	setting = GetConfigOption("fencegate.pass", true, false);
	if (setting == NULL || setting[0] == '\0')
		ereport(ERROR,
				(errcode(ERRCODE_FG_NO_PASS),
				 errmsg("fencegate: %s on %s.%s needs a fencing token: no fencegate.guard(token) in this transaction",
						trigger_op(trigdata), REL_SCHEMA(rel), REL_NAME(rel)),
				 errhint(PASS_HINT)));
	/* Our own copy: nothing below may see the setting change under it. */
	pass = pstrdup(setting);
	len = strlen(pass);

	/* pg_current_xact_id(), as the plpgsql version: assigns the transaction id if none yet. */
	fxid = GetTopFullTransactionId();
	/* The snapshot an SPI query of a VOLATILE function takes (new per call in READ COMMITTED). */
	PushActiveSnapshot(GetTransactionSnapshot());
	snap = GetActiveSnapshot();

	if (!(verified_pass != NULL
		  && FullTransactionIdEquals(verified_fxid, fxid)
		  && verified_len == len
		  && memcmp(verified_pass, pass, len) == 0))
	{
		if (len < PASS_TAIL_LEN || pass[len - PASS_TAIL_LEN] != ':'
			|| !mac_verifies(pass, len, fxid, snap))
			ereport(ERROR,
					(errcode(ERRCODE_FG_NO_PASS),
					 errmsg("fencegate: %s on %s.%s refused: fencegate.pass was not made by fencegate.guard in this transaction",
							trigger_op(trigdata), REL_SCHEMA(rel), REL_NAME(rel)),
					 errhint(PASS_HINT)));
		{
			/* Copy first: if the copy fails, the cache still holds its old, valid entry. */
			char	   *copy = MemoryContextStrdup(TopMemoryContext, pass);

			if (verified_pass != NULL)
				pfree(verified_pass);
			verified_pass = copy;
			verified_len = len;
			verified_fxid = fxid;
		}
	}

	/* The MAC verified: `held` is `revision:resource` as the guard wrote it. */
	held_len = len - PASS_TAIL_LEN;
	held = pnstrdup(pass, held_len);
	colon = strchr(held, ':');
	revision_text = held;
	if (colon != NULL)
	{
		*colon = '\0';
		resource = colon + 1;
	}
	else
		resource = pnstrdup(pass, held_len);	/* as substr/split_part; the guard never writes it */

	if (bound != NULL && bound[0] != '\0' && strcmp(bound, resource) != 0)
		ereport(ERROR,
				(errcode(ERRCODE_FG_RESOURCE),
				 errmsg("fencegate: %s on %s.%s refused: the table belongs to resource %s, the token names %s",
						trigger_op(trigdata), REL_SCHEMA(rel), REL_NAME(rel), bound, resource)));

	locked = lock_fence(resource, pg_strtoint64(revision_text), snap, &fence);
	PopActiveSnapshot();
	if (!locked)
		/* The fence moved past the pass's revision (or its row is gone). */
		ereport(ERROR,
				(errcode(ERRCODE_FG_STALE),
				 errmsg("fencegate: stale token for resource %s: revision %s is below the fence %s",
						resource, revision_text, fence),
				 errdetail("resource=%s revision=%s fence=%s", resource, revision_text, fence)));
	return PointerGetDatum(NULL);
}
