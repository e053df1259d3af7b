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
 * over `pass2:pid:txid:revision:resource` (see fencegate.set_pass). The fence lock is taken
 * (fence_lock.c) and the fence read again on every statement: a savepoint rolled back releases
 * the guard's lock while the client can put the pass string back.
 *
 * It reads the pass key and the fence through the table and index access methods, not SPI: an
 * SPI query costs about 33k instructions per call in executor set-up alone, the whole budget of
 * the 5 % target (docs/BENCHMARKS.md). The fence lock waits for a writer of the fence row in
 * progress; the fence is then read under a snapshot taken after the wait, in every isolation
 * level, so a raise that committed meanwhile refuses the write (FG001).
 *
 * It runs SECURITY DEFINER as the schema's owner inside the server: it looks up its relations by
 * schema and name (`fencegate`), never through the caller's search_path or pg_temp, and calls no
 * operator or function the caller could define; the client-set pass is only read within its
 * length; the MAC is compared in constant time. It checks no table privileges: it only reads
 * rows of its owner's own tables and takes the fence lock, and a check could only make it
 * refuse more.
 */
#include "postgres.h"

#include "access/xact.h"
#include "commands/trigger.h"
#include "fmgr.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/rel.h"
#include "utils/snapmgr.h"

#include "fence_store.h"

PG_MODULE_MAGIC;

PG_FUNCTION_INFO_V1(fencegate_enforce);

#define PASS_HINT \
	"Call SELECT fencegate.guard('<token>') first in the same transaction (the gateway does it for you). " \
	"A procedure that COMMITs ends the guarded transaction."

/*
 * The last pass whose MAC verified, and the top transaction it verified in: later statements of
 * the same transaction with the same pass text skip the key read and the MAC (the MAC binds the
 * pass to this backend and transaction, so the result cannot differ). Never the fence lock. The
 * C guard enters the pass it made (it computed that MAC itself), so even the first statement
 * skips them.
 * A pass verified once stays verified until its transaction ends, even if the pass key is
 * replaced meanwhile (only `fencegate postgres install` writes it); the plpgsql version would
 * refuse it at the next statement.
 */
static FullTransactionId verified_fxid;
static char *verified_pass = NULL;	/* in TopMemoryContext */
static size_t verified_len = 0;

void
fencegate_remember_pass(const char *pass, FullTransactionId fxid)
{
	/* Copy first: if the copy fails, the cache still holds its old, valid entry. */
	char	   *copy = MemoryContextStrdup(TopMemoryContext, pass);

	if (verified_pass != NULL)
		pfree(verified_pass);
	verified_pass = copy;
	verified_len = strlen(copy);
	verified_fxid = fxid;
}

/*
 * Whether the last MAC_HEX_LEN bytes of the pass are the MAC of `held` (the pass without its
 * `:mac` tail) in this backend's current top transaction, with the pass key read under `snap`.
 */
static bool
mac_verifies(const char *pass, size_t len, FullTransactionId fxid, Snapshot snap)
{
	static const char hex[] = "0123456789abcdef";
	const char *given = pass + len - MAC_HEX_LEN;
	uint8		outer[PG_SHA256_DIGEST_LENGTH];
	volatile uint8 diff = 0;
	int			i;

	fencegate_pass_mac(pass, len - PASS_TAIL_LEN, fxid, snap, outer);
	for (i = 0; i < PG_SHA256_DIGEST_LENGTH; i++)
	{
		diff |= (uint8) given[2 * i] ^ (uint8) hex[outer[i] >> 4];
		diff |= (uint8) given[2 * i + 1] ^ (uint8) hex[outer[i] & 0x0f];
	}
	return diff == 0;
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

	if (!(verified_pass != NULL
		  && FullTransactionIdEquals(verified_fxid, fxid)
		  && verified_len == len
		  && memcmp(verified_pass, pass, len) == 0))
	{
		bool		verifies;

		/* The snapshot an SPI query of a VOLATILE function takes (new per call in READ COMMITTED). */
		PushActiveSnapshot(GetTransactionSnapshot());
		snap = GetActiveSnapshot();
		verifies = len >= PASS_TAIL_LEN && pass[len - PASS_TAIL_LEN] == ':'
			&& mac_verifies(pass, len, fxid, snap);
		PopActiveSnapshot();
		if (!verifies)
			ereport(ERROR,
					(errcode(ERRCODE_FG_NO_PASS),
					 errmsg("fencegate: %s on %s.%s refused: fencegate.pass was not made by fencegate.guard in this transaction",
							trigger_op(trigdata), REL_SCHEMA(rel), REL_NAME(rel)),
					 errhint(PASS_HINT)));
		fencegate_remember_pass(pass, fxid);
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

	locked = fencegate_share_fence(resource, pg_strtoint64(revision_text), LockWaitBlock, &fence);
	if (!locked)
		/* The fence moved past the pass's revision (or its row is gone). */
		ereport(ERROR,
				(errcode(ERRCODE_FG_STALE),
				 errmsg("fencegate: stale token for resource %s: revision %s is below the fence %s",
						resource, revision_text, fence),
				 errdetail("resource=%s revision=%s fence=%s", resource, revision_text, fence)));
	return PointerGetDatum(NULL);
}
